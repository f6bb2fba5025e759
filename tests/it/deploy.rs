//! The deploy files pass a security review, and their validators run here.
//!
//! `scripts/validate-deploy` installs schema validators (PyPI, npm) under
//! `target/deploy-tools`, renders the Helm chart with Helm's own engine and
//! validates every object against Kubernetes' schemas (KEDA's and the
//! Prometheus Operator's for their resources) and `docker-compose.yml`
//! against the Compose specification. The tests below then read what it
//! rendered and check what a schema cannot: every container unprivileged,
//! credentials only from Secrets, no default password anywhere, RabbitMQ
//! definitions that match what the workers declare; and the definitions are
//! loaded into RabbitMQ and a fleet runs as their least-privilege user.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
    time::Duration,
};

use common::{draw, pool_toml, spawn_binary_with, KillOnDrop, TestEnv};
use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Passwords a deploy file must never carry.
const DEFAULT_PASSWORDS: [&str; 10] = [
    "guest",
    "password",
    "postgres",
    "redis",
    "admin",
    "root",
    "secret",
    "changeme",
    "prizepool",
    "test",
];

/// Runs `scripts/validate-deploy` once for the whole file and returns the
/// directory where it wrote what it checked. Panics with its report if any
/// validation failed.
fn validated() -> &'static Path {
    static CHECKED: OnceLock<PathBuf> = OnceLock::new();
    CHECKED.get_or_init(|| {
        let out = Command::new(format!("{ROOT}/scripts/validate-deploy"))
            .output()
            .expect("scripts/validate-deploy runs");
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "deploy validation failed:\n{report}");
        assert!(report.contains("all deploy files are valid"), "{report}");
        PathBuf::from(format!("{ROOT}/target/deploy-tools/checked"))
    })
}

fn read_json(path: impl AsRef<Path>) -> Value {
    let path = path.as_ref();
    serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every rendering of the chart: (values set, objects).
fn renderings() -> Vec<(String, Vec<Value>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(validated()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if let Some(set) = name
            .strip_prefix("chart-")
            .and_then(|n| n.strip_suffix(".json"))
        {
            let objects = read_json(&path)
                .as_array()
                .unwrap()
                .iter()
                .map(|item| item["object"].clone())
                .collect();
            out.push((set.to_owned(), objects));
        }
    }
    assert!(
        out.iter().any(|(set, _)| set == "defaults"),
        "no rendering with the chart's defaults: {:?}",
        out.iter().map(|(s, _)| s).collect::<Vec<_>>()
    );
    out
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn name(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap()
}

/// The pod template of a Deployment or Job.
fn pod(object: &Value) -> &Value {
    &object["spec"]["template"]
}

/// Renders the chart with `values` (JSON) through the script.
fn render(values: &Value) -> Result<Vec<Value>, String> {
    validated();
    let out = Command::new(format!("{ROOT}/scripts/validate-deploy"))
        .args(["render", &values.to_string()])
        .output()
        .unwrap();
    if out.status.success() {
        let items: Value = serde_json::from_slice(&out.stdout).unwrap();
        Ok(items
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["object"].clone())
            .collect())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn every_deploy_file_passes_its_schema_validator() {
    let checked = validated();
    assert!(checked.join("compose.json").exists());
    // Each rendering holds the three workers and their budgets; the chart's
    // defaults add the migration Job and the autoscalers.
    let sets = renderings();
    let names: BTreeSet<&str> = sets.iter().map(|(s, _)| s.as_str()).collect();
    for set in [
        "defaults",
        "chart-secret",
        "production-values",
        "fixed-replicas-values",
    ] {
        assert!(names.contains(set), "no rendering {set}: {names:?}");
    }
    for (set, objects) in &sets {
        let deployments: BTreeSet<&str> = of_kind(objects, "Deployment")
            .into_iter()
            .map(name)
            .collect();
        assert_eq!(
            deployments,
            BTreeSet::from([
                "prizepool-draw-worker",
                "prizepool-refill-worker",
                "prizepool-settle-worker"
            ]),
            "{set}"
        );
        assert_eq!(of_kind(objects, "PodDisruptionBudget").len(), 3, "{set}");
        if set == "defaults" {
            assert_eq!(of_kind(objects, "Job").len(), 1, "{set}");
            assert_eq!(of_kind(objects, "ScaledObject").len(), 2, "{set}");
        }
    }
    // The production rendering has a PodMonitor that scrapes the ops port
    // of exactly the three worker kinds' pods (validated against the
    // Prometheus Operator's CRD above).
    let (_, production) = sets.iter().find(|(s, _)| s == "production-values").unwrap();
    let monitors = of_kind(production, "PodMonitor");
    assert_eq!(monitors.len(), 1, "{monitors:?}");
    let spec = &monitors[0]["spec"];
    assert_eq!(spec["podMetricsEndpoints"][0]["port"], "ops");
    assert_eq!(spec["podMetricsEndpoints"][0]["path"], "/metrics");
    assert_eq!(
        spec["selector"]["matchExpressions"][0]["values"],
        serde_json::json!(["draw-worker", "refill-worker", "settle-worker"])
    );
    for deployment in of_kind(production, "Deployment") {
        let labels = &pod(deployment)["metadata"]["labels"];
        for (k, v) in spec["selector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(&labels[k], v, "{}", name(deployment));
        }
        let ports = &pod(deployment)["spec"]["containers"][0]["ports"];
        assert!(ports.as_array().unwrap().iter().any(|p| p["name"] == "ops"));
    }
    assert_eq!(monitors[0]["metadata"]["labels"]["release"], "prometheus");
    // KEDA reads the broker over TLS there: the host from the Secret key the
    // docs name, TLS on, the workers' CA and client certificate.
    let auth = of_kind(production, "TriggerAuthentication");
    assert_eq!(auth.len(), 1);
    let refs: BTreeSet<(&str, &str, &str)> = auth[0]["spec"]["secretTargetRef"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["parameter"].as_str().unwrap(),
                r["name"].as_str().unwrap(),
                r["key"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        refs,
        BTreeSet::from([
            ("host", "prizepool-production", "AMQP_URL"),
            ("tls", "prizepool-keda-tls", "tls"),
            ("ca", "prizepool-tls", "ca.crt"),
            ("cert", "prizepool-tls", "tls.crt"),
            ("key", "prizepool-tls", "tls.key"),
        ])
    );
    let enable = of_kind(production, "Secret")
        .into_iter()
        .find(|s| name(s) == "prizepool-keda-tls")
        .expect("the Secret that turns the scaler's TLS on");
    assert_eq!(enable["stringData"]["tls"], "enable");
}

#[test]
fn every_container_runs_unprivileged_with_a_read_only_root_and_bounded_resources() {
    for (set, objects) in renderings() {
        let workloads: Vec<&Value> = objects
            .iter()
            .filter(|o| o["kind"] == "Deployment" || o["kind"] == "Job")
            .collect();
        assert!(!workloads.is_empty(), "{set}");
        for workload in workloads {
            let at = format!("{set}: {}/{}", workload["kind"], name(workload));
            let spec = &pod(workload)["spec"];
            let pod_security = &spec["securityContext"];
            assert_eq!(pod_security["runAsNonRoot"], true, "{at}");
            assert_eq!(
                pod_security["seccompProfile"]["type"], "RuntimeDefault",
                "{at}"
            );
            assert_eq!(spec["automountServiceAccountToken"], false, "{at}");
            for host in ["hostNetwork", "hostPID", "hostIPC"] {
                assert_ne!(spec[host], true, "{at}: {host}");
            }
            for volume in spec["volumes"].as_array().into_iter().flatten() {
                assert!(volume.get("hostPath").is_none(), "{at}: {volume}");
            }
            let containers: Vec<&Value> = ["initContainers", "containers"]
                .iter()
                .flat_map(|k| spec[*k].as_array().into_iter().flatten())
                .collect();
            assert!(!containers.is_empty(), "{at}");
            for c in containers {
                let at = format!("{at} container {}", c["name"]);
                let security = &c["securityContext"];
                assert_eq!(security["runAsNonRoot"], true, "{at}");
                let uid = security["runAsUser"]
                    .as_u64()
                    .or(pod_security["runAsUser"].as_u64());
                assert!(uid.is_some_and(|u| u != 0), "{at}: runAsUser {uid:?}");
                assert_eq!(security["readOnlyRootFilesystem"], true, "{at}");
                assert_eq!(security["allowPrivilegeEscalation"], false, "{at}");
                assert_ne!(security["privileged"], true, "{at}");
                let dropped = security["capabilities"]["drop"].as_array();
                assert!(
                    dropped.is_some_and(|d| d.iter().any(|c| c == "ALL")),
                    "{at}: capabilities {}",
                    security["capabilities"]
                );
                assert!(
                    security["capabilities"]["add"]
                        .as_array()
                        .is_none_or(|a| a.is_empty()),
                    "{at}"
                );
                for bound in ["requests", "limits"] {
                    for resource in ["cpu", "memory"] {
                        assert!(
                            c["resources"][bound][resource].is_string(),
                            "{at}: no {bound}.{resource}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn workers_are_probed_budgeted_and_take_credentials_only_from_secrets() {
    let definitions = read_json(format!("{ROOT}/deploy/rabbitmq/definitions.json"));
    let queues: BTreeSet<&str> = definitions["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["name"].as_str().unwrap())
        .collect();
    for (set, objects) in renderings() {
        let budgets = of_kind(&objects, "PodDisruptionBudget");
        for deployment in of_kind(&objects, "Deployment") {
            let at = format!("{set}: {}", name(deployment));
            let labels = &pod(deployment)["metadata"]["labels"];
            let containers = pod(deployment)["spec"]["containers"].as_array().unwrap();
            assert_eq!(containers.len(), 1, "{at}");
            let c = &containers[0];
            // The binary named after the worker.
            let part = name(deployment).trim_start_matches("prizepool-");
            assert_eq!(c["command"], serde_json::json!([part]), "{at}");
            // Probes on the ops endpoint, which METRICS_ADDR puts on that port.
            let env: BTreeMap<&str, &Value> = c["env"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| (e["name"].as_str().unwrap(), e))
                .collect();
            let metrics_addr = env["METRICS_ADDR"]["value"].as_str().unwrap();
            let port = c["ports"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == "ops")
                .unwrap()["containerPort"]
                .as_u64()
                .unwrap();
            assert_eq!(metrics_addr, format!("0.0.0.0:{port}"), "{at}");
            assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz", "{at}");
            assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz", "{at}");
            for probe in ["readinessProbe", "livenessProbe"] {
                assert_eq!(c[probe]["httpGet"]["port"], "ops", "{at}");
            }
            // Credentials come from the Secret, never as plain values.
            for secret in ["AMQP_URL", "REDIS_URL", "DATABASE_URL", "LEDGER_SEAL_KEY"] {
                let var = env
                    .get(secret)
                    .unwrap_or_else(|| panic!("{at}: no {secret}"));
                assert!(var.get("value").is_none(), "{at}: {secret} in plain text");
                assert_eq!(var["valueFrom"]["secretKeyRef"]["key"], secret, "{at}");
            }
            // A disruption budget selects this worker's pods, and only them.
            let selecting: Vec<&&Value> = budgets
                .iter()
                .filter(|b| {
                    b["spec"]["selector"]["matchLabels"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .all(|(k, v)| &labels[k] == v)
                })
                .collect();
            assert_eq!(selecting.len(), 1, "{at}: budgets {selecting:?}");
            // A worker may not be killed wholesale during a rollout.
            assert_eq!(
                deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0,
                "{at}"
            );
        }
        // Migrations run once per install or upgrade, before the workers.
        for job in of_kind(&objects, "Job") {
            let migrate = &pod(job)["spec"]["containers"][0];
            assert_eq!(
                migrate["command"],
                serde_json::json!(["prizepool", "migrate"])
            );
            let hooks = job["metadata"]["annotations"]["helm.sh/hook"]
                .as_str()
                .unwrap();
            assert!(
                hooks.contains("pre-install") && hooks.contains("pre-upgrade"),
                "{hooks}"
            );
        }
        // Autoscaling targets the Deployments on queues the broker has.
        let deployments: BTreeSet<&str> = of_kind(&objects, "Deployment")
            .into_iter()
            .map(name)
            .collect();
        let scaled = of_kind(&objects, "ScaledObject");
        // Without autoscalers every worker has a replica count of its own.
        if scaled.is_empty() {
            for d in of_kind(&objects, "Deployment") {
                assert!(
                    d["spec"]["replicas"].as_u64().is_some(),
                    "{set}: {}",
                    name(d)
                );
            }
        }
        // The draw workers scale on every draw shard they consume: the
        // shards past the first are declared by the workers, not the
        // definitions.
        let shards = draw_shards(&objects);
        for s in scaled {
            let target = s["spec"]["scaleTargetRef"]["name"].as_str().unwrap();
            assert!(deployments.contains(target), "{set}: {target}");
            assert!(
                deployment_replicas_left_to_keda(&objects, target),
                "{set}: {target} sets replicas while KEDA scales it"
            );
            let triggered: Vec<&str> = s["spec"]["triggers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["metadata"]["queueName"].as_str().unwrap())
                .collect();
            let expected: Vec<String> = if target == "prizepool-draw-worker" {
                (0..shards)
                    .map(|k| match k {
                        0 => "prizepool.draw".to_owned(),
                        k => format!("prizepool.draw.{k}"),
                    })
                    .collect()
            } else {
                triggered.iter().map(|q| (*q).to_owned()).collect()
            };
            assert_eq!(triggered, expected, "{set}: {target}");
            for queue in triggered
                .iter()
                .filter(|q| !q.starts_with("prizepool.draw."))
            {
                assert!(queues.contains(queue), "{set}: {queue}");
            }
        }
    }
}

/// The `DRAW_SHARDS` the draw workers of a rendering run with.
fn draw_shards(objects: &[Value]) -> u64 {
    let draw = of_kind(objects, "Deployment")
        .into_iter()
        .find(|d| name(d) == "prizepool-draw-worker")
        .unwrap();
    pod(draw)["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "DRAW_SHARDS")
        .map_or(1, |e| e["value"].as_str().unwrap().parse().unwrap())
}

fn deployment_replicas_left_to_keda(objects: &[Value], target: &str) -> bool {
    of_kind(objects, "Deployment")
        .into_iter()
        .find(|d| name(d) == target)
        .is_some_and(|d| d["spec"].get("replicas").is_none())
}

#[test]
fn the_chart_refuses_default_and_missing_passwords() {
    let strong = "Zq7-wV2pT9xLk4mR8sN3bH6c";
    let secrets = |amqp: &str, redis: &str, database: &str, key: &str| {
        serde_json::json!({"secrets": {
            "create": true, "amqpUrl": amqp, "redisUrl": redis,
            "databaseUrl": database, "ledgerSealKey": key,
        }})
    };
    let amqp = format!("amqps://prizepool:{strong}@rabbitmq:5671/prizepool");
    let redis = format!("rediss://prizepool:{strong}@redis:6380");
    let database = format!("postgres://prizepool:{strong}@db:5432/prizepool");
    let key = "k".repeat(32);

    let objects = render(&secrets(&amqp, &redis, &database, &key)).unwrap();
    let secret = of_kind(&objects, "Secret")[0];
    assert_eq!(
        secret["stringData"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect::<BTreeSet<_>>(),
        BTreeSet::from(["AMQP_URL", "DATABASE_URL", "LEDGER_SEAL_KEY", "REDIS_URL"])
    );

    let refused = [
        (
            secrets(
                "amqp://guest:guest@rabbitmq:5672/%2f",
                &redis,
                &database,
                &key,
            ),
            "AMQP_URL",
        ),
        (
            secrets(&amqp, "redis://redis:6379", &database, &key),
            "REDIS_URL",
        ),
        (
            secrets(
                &amqp,
                &format!("redis://a:{strong}@r1:6379,redis://:Password@r2:6379"),
                &database,
                &key,
            ),
            "REDIS_URL",
        ),
        (
            secrets(
                &amqp,
                &redis,
                "postgres://postgres:postgres@db:5432/prizepool",
                &key,
            ),
            "DATABASE_URL",
        ),
        (
            secrets(
                &amqp,
                &redis,
                "postgres://prizepool@db:5432/prizepool",
                &key,
            ),
            "DATABASE_URL",
        ),
        (secrets(&amqp, &redis, &database, "short"), "ledgerSealKey"),
        (secrets("", &redis, &database, &key), "amqpUrl"),
    ];
    for (values, named) in refused {
        let error = render(&values).expect_err(&values.to_string());
        assert!(error.contains(named), "{values}: {error}");
        assert!(
            !error.contains(strong),
            "the error shows a password: {error}"
        );
    }

    // What validate-deploy rendered with a Secret of the chart's holds no
    // default password either.
    for (set, objects) in renderings() {
        for secret in of_kind(&objects, "Secret") {
            for (k, v) in secret["stringData"].as_object().unwrap() {
                let v = v.as_str().unwrap();
                for weak in DEFAULT_PASSWORDS {
                    assert!(
                        !v.contains(&format!(":{weak}@")),
                        "{set}: {k} holds the password {weak}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_chart_refuses_values_it_does_not_know() {
    for (values, named) in [
        (
            serde_json::json!({"workers": {"draw": {"replicaz": 3}}}),
            "replicaz",
        ),
        (
            serde_json::json!({"image": {"pullPolicy": "Sometimes"}}),
            "pullPolicy",
        ),
        // Credentials never as plain config values.
        (
            serde_json::json!({"config": {"DATABASE_URL": "postgres://x"}}),
            "DATABASE_URL",
        ),
    ] {
        let error = render(&values).expect_err(&values.to_string());
        assert!(error.contains(named), "{values}: {error}");
    }
    assert!(render(&serde_json::json!({"workers": {"draw": {"replicas": 3}}})).is_ok());
}

#[test]
fn rabbitmq_definitions_have_no_guest_and_declare_what_the_workers_declare() {
    use prizepool::amqp::{DELAY_TIERS, DLX, EVENTS, EXCHANGE, REFILL, ROUTES};
    let d = read_json(format!("{ROOT}/deploy/rabbitmq/definitions.json"));
    let delivery_limit = prizepool::config::Config::from_lookup(|_| None)
        .unwrap()
        .delivery_limit;

    // Users: one, without a password of its own, no tags, no `.*`.
    let users = d["users"].as_array().unwrap();
    assert!(users.iter().all(|u| u["name"] != "guest"), "{users:?}");
    for user in users {
        assert_eq!(user["tags"], serde_json::json!([]), "{user}");
        assert_eq!(user["password_hash"], "", "a committed password: {user}");
    }
    for p in d["permissions"].as_array().unwrap() {
        for what in ["configure", "write", "read"] {
            let pattern = p[what].as_str().unwrap();
            assert!(
                pattern.starts_with('^') && pattern.ends_with('$') && !pattern.contains(".*"),
                "{what}: {pattern}"
            );
        }
    }

    let queues: BTreeMap<&str, &Value> = d["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| (q["name"].as_str().unwrap(), &q["arguments"]))
        .collect();
    let mut expected = BTreeSet::new();
    // The work queues and the audit trail's queue, declared alike.
    let dead_lettering = || ROUTES.into_iter().chain([prizepool::audit::ROUTE]);
    for route in dead_lettering() {
        expected.insert(route.queue);
        expected.insert(route.dlq);
        let args = queues[route.queue];
        assert_eq!(args["x-queue-type"], "quorum");
        assert_eq!(args["x-delivery-limit"], delivery_limit);
        assert_eq!(args["x-dead-letter-exchange"], DLX);
        assert_eq!(args["x-dead-letter-routing-key"], route.queue);
        assert_eq!(args["x-dead-letter-strategy"], "at-least-once");
        assert_eq!(args["x-overflow"], "reject-publish");
        assert_eq!(
            queues[route.dlq],
            &serde_json::json!({"x-queue-type": "quorum"})
        );
    }
    for (delay, ttl) in DELAY_TIERS {
        expected.insert(delay);
        let args = queues[delay];
        assert_eq!(args["x-message-ttl"], ttl, "{delay}");
        assert_eq!(args["x-dead-letter-exchange"], EXCHANGE, "{delay}");
        assert_eq!(
            args["x-dead-letter-routing-key"], REFILL.routing_key,
            "{delay}"
        );
    }
    assert_eq!(queues.keys().copied().collect::<BTreeSet<_>>(), expected);
    let exchanges: BTreeSet<&str> = d["exchanges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(exchanges, BTreeSet::from([EXCHANGE, DLX, EVENTS]));
    // The bindings the workers make: each DLQ to the dead-letter exchange,
    // each work queue to its key, the audit queue to the events it records.
    let bindings: BTreeSet<(&str, &str, &str)> = d["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["source"].as_str().unwrap(),
                b["destination"].as_str().unwrap(),
                b["routing_key"].as_str().unwrap(),
            )
        })
        .collect();
    let mut wanted = BTreeSet::new();
    for route in dead_lettering() {
        wanted.insert((DLX, route.dlq, route.queue));
    }
    for route in ROUTES {
        wanted.insert((EXCHANGE, route.queue, route.routing_key));
    }
    for key in prizepool::audit::EVENTS {
        wanted.insert((EVENTS, prizepool::audit::ROUTE.queue, key));
    }
    assert_eq!(bindings, wanted);

    // A policy per work queue: the delivery limit and dead-lettering, as
    // DELIVERY_LIMIT says (also in the chart's values).
    let policies = d["policies"].as_array().unwrap();
    for route in dead_lettering() {
        let matching: Vec<&Value> = policies
            .iter()
            .filter(|p| {
                p["pattern"].as_str().unwrap() == format!("^{}$", route.queue.replace('.', "\\."))
            })
            .collect();
        assert_eq!(matching.len(), 1, "{}", route.queue);
        let def = &matching[0]["definition"];
        assert_eq!(def["delivery-limit"], delivery_limit);
        assert_eq!(def["dead-letter-exchange"], DLX);
        assert_eq!(def["dead-letter-routing-key"], route.queue);
    }
    let values =
        std::fs::read_to_string(format!("{ROOT}/deploy/helm/prizepool/values.yaml")).unwrap();
    assert!(
        values.contains(&format!("DELIVERY_LIMIT: \"{delivery_limit}\"")),
        "the chart's DELIVERY_LIMIT differs from the definitions'"
    );
}

#[test]
fn compose_gates_every_worker_on_healthy_servers_and_keeps_no_password() {
    let compose = read_json(validated().join("compose.json"));
    let text = std::fs::read_to_string(format!("{ROOT}/docker-compose.yml")).unwrap();
    assert!(!text.contains("guest"), "docker-compose.yml mentions guest");
    assert!(!text.contains("POSTGRES_HOST_AUTH_METHOD"), "trust auth");
    let services = compose["services"].as_object().unwrap();
    // Every password is interpolated from the environment, and required.
    for (service, s) in services {
        for (k, v) in s["environment"].as_object().into_iter().flatten() {
            let v = v.as_str().unwrap_or_default();
            if k.contains("PASSWORD")
                || k.contains("AUTH")
                || k.ends_with("_URL")
                || k == "LEDGER_SEAL_KEY"
            {
                if k == "OTEL_EXPORTER_OTLP_ENDPOINT" {
                    continue;
                }
                assert!(v.contains("${") && v.contains(":?"), "{service}: {k} = {v}");
            }
        }
    }
    let redis = services["redis"]["command"].to_string();
    assert!(redis.contains("--requirepass"), "{redis}");
    for server in ["redis", "rabbitmq", "postgres"] {
        assert!(
            services[server]["healthcheck"]["test"].is_array(),
            "{server}"
        );
        assert!(services[server]["restart"].is_string(), "{server}");
    }
    let migrate = &services["migrate"];
    assert_eq!(
        migrate["command"],
        serde_json::json!(["prizepool", "migrate"])
    );
    for worker in ["draw-worker", "refill-worker", "settle-worker"] {
        let s = &services[worker];
        assert_eq!(s["command"], serde_json::json!([worker]));
        assert_eq!(s["restart"], "unless-stopped", "{worker}");
        assert!(
            s["healthcheck"]["test"].to_string().contains("/readyz"),
            "{worker}"
        );
        let depends = s["depends_on"].as_object().unwrap();
        for server in ["rabbitmq", "redis", "postgres"] {
            assert_eq!(depends[server]["condition"], "service_healthy", "{worker}");
        }
        assert_eq!(
            depends["migrate"]["condition"], "service_completed_successfully",
            "{worker}"
        );
        assert_eq!(s["read_only"], true, "{worker}");
        assert_eq!(s["cap_drop"], serde_json::json!(["ALL"]), "{worker}");
        let user = s["user"].as_str().unwrap();
        assert!(
            !user.starts_with("0") && !user.starts_with("root"),
            "{worker}: {user}"
        );
    }
}

#[test]
fn the_image_runs_as_a_numeric_non_root_user_and_ships_no_build_context_secrets() {
    let dockerfile = std::fs::read_to_string(format!("{ROOT}/deploy/Dockerfile")).unwrap();
    let runtime = dockerfile.rsplit("\nFROM ").next().unwrap();
    let user = runtime
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("USER "))
        .expect("the runtime stage sets USER");
    let uid: u32 = user
        .split(':')
        .next()
        .unwrap()
        .parse()
        .expect("numeric uid");
    assert_ne!(uid, 0);
    assert!(dockerfile.contains("--locked"));
    // The binaries it ships carry no debug info and no symbols.
    assert!(dockerfile.contains("--profile image") && dockerfile.contains("target/image/"));
    assert!(!dockerfile.contains("target/release/"));
    let cargo: toml::Table = std::fs::read_to_string(format!("{ROOT}/Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let image = &cargo["profile"]["image"];
    assert_eq!(image["inherits"].as_str(), Some("release"));
    assert_eq!(image["debug"].as_bool(), Some(false));
    assert_eq!(image["strip"].as_bool(), Some(true));
    let ignore = std::fs::read_to_string(format!("{ROOT}/.dockerignore")).unwrap();
    let ignored: BTreeSet<&str> = ignore.lines().map(str::trim).collect();
    for entry in ["target", ".git", "**/.env", "*.pem", "*.key"] {
        assert!(ignored.contains(entry), ".dockerignore lacks {entry}");
    }
}

/// The names the image puts on its PATH: the binary its build stage copies
/// from `target/image/` and the links it makes to it.
fn shipped_commands(dockerfile: &str) -> BTreeSet<String> {
    let mut shipped = BTreeSet::new();
    for line in dockerfile.lines() {
        let words: Vec<&str> = line
            .split_whitespace()
            .filter(|w| *w != "&&" && *w != "\\")
            .collect();
        match words.as_slice() {
            ["cp", from, "/out/bin/"] => {
                shipped.insert(from.strip_prefix("target/image/").unwrap().to_owned());
            }
            ["ln", "-s", target, link] => {
                assert_eq!(*target, "prizepool", "{line}");
                shipped.insert(link.strip_prefix("/out/bin/").unwrap().to_owned());
            }
            _ => {}
        }
    }
    shipped
}

/// A Dockerfile instruction's exec-form argument list (`CMD ["a", "b"]`).
fn exec_form(instruction: &str) -> Vec<String> {
    let start = instruction.find('[').expect("exec form");
    serde_json::from_str(&instruction[start..]).unwrap()
}

#[test]
fn the_image_ships_one_binary_on_a_distroless_base_and_every_command_the_deploy_files_run() {
    let dockerfile = std::fs::read_to_string(format!("{ROOT}/deploy/Dockerfile")).unwrap();
    let stages: Vec<&str> = dockerfile.split("\nFROM ").skip(1).collect();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let (build, runtime) = (stages[0], stages[1]);
    // The build: the prizepool binary alone, without debug info; the three
    // worker names are links to it.
    assert!(build.starts_with("rust:") && build.contains("-bookworm AS build"));
    assert!(build.contains("cargo build --profile image --locked --bin prizepool"));
    let shipped = shipped_commands(&dockerfile);
    assert_eq!(
        shipped,
        ["prizepool", "draw-worker", "refill-worker", "settle-worker"]
            .map(String::from)
            .into(),
    );
    // The runtime: distroless of the same Debian release (the same glibc),
    // with nothing run in it (it has no shell) and nothing but the binary,
    // its links and the examples added.
    let base = runtime.lines().next().unwrap();
    assert_eq!(base, "gcr.io/distroless/cc-debian12");
    assert!(build.starts_with("rust:1.") && build.contains("bookworm"));
    let instructions: Vec<&str> = runtime
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#') && !l.starts_with(' '))
        .collect();
    for i in &instructions {
        let word = i.split_whitespace().next().unwrap();
        assert!(
            [
                "COPY",
                "WORKDIR",
                "ENV",
                "EXPOSE",
                "USER",
                "HEALTHCHECK",
                "CMD"
            ]
            .contains(&word),
            "the runtime stage runs or adds something: {i}"
        );
    }
    let copies: Vec<&&str> = instructions
        .iter()
        .filter(|i| i.starts_with("COPY"))
        .collect();
    assert_eq!(
        copies,
        [
            &"COPY --from=build /out/bin/ /usr/local/bin/",
            &"COPY examples /opt/prizepool/examples"
        ]
    );
    assert!(!runtime.contains("bash") && !runtime.contains("sh -c"));
    // Its health check and its default command are binaries it ships.
    let healthcheck = runtime
        .split_once("HEALTHCHECK ")
        .unwrap()
        .1
        .split_once("CMD ")
        .unwrap()
        .1
        .lines()
        .next()
        .unwrap();
    assert_eq!(exec_form(healthcheck), ["prizepool", "healthcheck"]);
    let cmd = instructions.iter().find(|i| i.starts_with("CMD ")).unwrap();
    assert!(shipped.contains(&exec_form(cmd)[0]), "{cmd}");

    // Every container of the chart runs a command the image ships.
    let mut run = BTreeSet::new();
    for (set, objects) in renderings() {
        for workload in objects
            .iter()
            .filter(|o| o["kind"] == "Deployment" || o["kind"] == "Job")
        {
            for c in pod(workload)["spec"]["containers"].as_array().unwrap() {
                let command = c["command"][0].as_str().unwrap();
                assert!(
                    shipped.contains(command),
                    "{set}: {}: {command}",
                    name(workload)
                );
                run.insert(command.to_owned());
            }
        }
    }
    // So does every service built from the image, and its health check.
    let compose = read_json(validated().join("compose.json"));
    for (service, s) in compose["services"].as_object().unwrap() {
        if s["image"] != "prizepool:local" {
            continue;
        }
        let command = s["command"][0].as_str().unwrap();
        assert!(shipped.contains(command), "{service}: {command}");
        run.insert(command.to_owned());
        if s["healthcheck"]["disable"] != true {
            let test = &s["healthcheck"]["test"];
            assert_eq!(test[0], "CMD", "{service}: exec form, no shell");
            assert_eq!(test[1], "prizepool", "{service}");
            assert_eq!(test[2], "healthcheck", "{service}");
        }
    }
    assert_eq!(
        run, shipped,
        "a shipped name that nothing runs, or the reverse"
    );
}

/// A directory laid out as the image's `/usr/local/bin`: `prizepool` and
/// the three worker names as links to it.
fn image_bin_dir() -> PathBuf {
    let dir = common::tempdir("image-bin");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_prizepool"), dir.join("prizepool")).unwrap();
    for worker in ["draw-worker", "refill-worker", "settle-worker"] {
        std::os::unix::fs::symlink("prizepool", dir.join(worker)).unwrap();
    }
    dir
}

#[test]
fn the_prizepool_binary_is_each_worker_under_its_name() {
    let dir = image_bin_dir();
    for (worker, queue, own) in [
        (
            "draw-worker",
            "prizepool.draw",
            env!("CARGO_BIN_EXE_draw-worker"),
        ),
        (
            "refill-worker",
            "prizepool.refill",
            env!("CARGO_BIN_EXE_refill-worker"),
        ),
        (
            "settle-worker",
            "prizepool.settle",
            env!("CARGO_BIN_EXE_settle-worker"),
        ),
    ] {
        // Run as the image runs it: by name, from the PATH.
        let out = Command::new(worker)
            .arg("--help")
            .env("PATH", &dir)
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{worker}: {help}");
        assert!(
            help.contains(&format!("Consumes {queue}:")),
            "{worker}: {help}"
        );
        assert!(
            help.contains(&format!("Usage: {worker}")),
            "{worker}: {help}"
        );
        assert!(help.contains("AMQP_URL"), "{worker}: {help}");
        // The same as the worker's own binary says.
        let own = Command::new(own).arg("--help").output().unwrap();
        assert_eq!(String::from_utf8_lossy(&own.stdout), help, "{worker}");
    }
    // Under its own name it is the command line.
    let out = Command::new(dir.join("prizepool"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("healthcheck") && help.contains("migrate"),
        "{help}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// `prizepool healthcheck` as the image's HEALTHCHECK and Compose run it:
/// in the worker's environment (METRICS_ADDR), against a worker started
/// under its link name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthcheck_passes_while_the_worker_is_ready_and_fails_once_it_is_gone() {
    let env = TestEnv::new(&[]).await;
    let dir = image_bin_dir();
    let port = common::free_port();
    // As the worker binds it; the check asks the loopback address.
    let metrics_addr = format!("0.0.0.0:{port}");
    let mut worker = KillOnDrop(spawn_binary_with(
        &env,
        "draw-worker",
        dir.join("draw-worker").to_str().unwrap(),
        &[("METRICS_ADDR", &metrics_addr)],
    ));
    let check = |path: &str| {
        Command::new(dir.join("prizepool"))
            .args(["healthcheck", "--path", path])
            .env("METRICS_ADDR", &metrics_addr)
            .output()
            .unwrap()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let ready = loop {
        let out = check("/readyz");
        if out.status.success() || tokio::time::Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let said = String::from_utf8_lossy(&ready.stdout);
    assert!(
        ready.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&ready.stderr)
    );
    assert!(said.contains(" 200 ") && said.contains("ready"), "{said}");
    // The process behind the port is the draw worker.
    let metrics = check("/metrics");
    assert!(metrics.status.success());
    let metrics = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        metrics.lines().any(|l| l.starts_with("prizepool_ready{")
            && l.contains(r#"worker="draw-worker""#)
            && l.ends_with(" 1")),
        "{metrics}"
    );
    // A path the endpoint does not serve, and a worker that is gone, fail.
    let missing = check("/nothing");
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains(" 404 "));
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let gone = check("/readyz");
    assert_eq!(gone.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("connecting to 127.0.0.1:"),
        "{}",
        String::from_utf8_lossy(&gone.stderr)
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// `rabbitmqctl` on the shared broker, failing the test with its output.
fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Deletes a RabbitMQ user when dropped.
struct RabbitUser(String);

impl Drop for RabbitUser {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["delete_user", &self.0])
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_definitions_load_into_rabbitmq_and_the_fleet_runs_as_their_least_privilege_user() {
    let env = TestEnv::new(&[]).await;
    // The file as shipped, with the vhost and user renamed to the test's own
    // (the broker is shared).
    let user = format!("{}-app", env.vhost);
    let _user = RabbitUser(user.clone());
    let mut d = read_json(format!("{ROOT}/deploy/rabbitmq/definitions.json"));
    let shipped_vhost = d["vhosts"][0]["name"].as_str().unwrap().to_owned();
    let shipped_user = d["users"][0]["name"].as_str().unwrap().to_owned();
    d["vhosts"] = serde_json::json!([{"name": env.vhost}]);
    d["users"][0]["name"] = user.clone().into();
    d["permissions"][0]["user"] = user.clone().into();
    for section in ["permissions", "policies", "exchanges", "queues", "bindings"] {
        for item in d[section].as_array_mut().unwrap() {
            assert_eq!(item["vhost"], shipped_vhost.as_str());
            item["vhost"] = env.vhost.clone().into();
        }
    }
    assert_eq!(shipped_user, "prizepool");
    let file = common::tempdir("definitions").join("definitions.json");
    std::fs::write(&file, d.to_string()).unwrap();
    rabbitmqctl(&["import_definitions", file.to_str().unwrap()]);
    let password = ulid::Ulid::new().to_string();
    // Imported without a password: nobody can log in as it yet.
    let before = Command::new("rabbitmqctl")
        .args(["authenticate_user", &user, ""])
        .output()
        .unwrap();
    assert!(!before.status.success());
    rabbitmqctl(&["change_password", &user, &password]);
    let users = rabbitmqctl(&["list_users", "--formatter", "json"]);
    let listed: Value = serde_json::from_str(users.trim()).unwrap();
    let entry = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["user"] == user.as_str())
        .unwrap();
    assert_eq!(entry["tags"], serde_json::json!([]), "{entry}");

    // The workers declare their topology, consume, publish settlements and
    // reply, all as that user.
    let url = format!("amqp://{user}:{password}@127.0.0.1:5672/{}", env.vhost);
    env.load(&pool_toml("defs", "", &[("a", &[(0, 20), (1, 20)])]))
        .await;
    let _workers: Vec<KillOnDrop> = [
        ("draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
        ("settle-worker", env!("CARGO_BIN_EXE_settle-worker")),
    ]
    .into_iter()
    .map(|(n, exe)| KillOnDrop(spawn_binary_with(&env, n, exe, &[("AMQP_URL", &url)])))
    .collect();
    let client = env.client().await;
    let reply = client
        .call("draw", &draw("defs", 7, 3), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");

    // Least privilege: nothing outside the fleet's names.
    let conn = prizepool::amqp::connect(&url, "least-privilege")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let refused = channel
        .queue_declare(
            "other.queue".into(),
            lapin::options::QueueDeclareOptions::default(),
            Default::default(),
        )
        .await;
    let error = refused.expect_err("declared a queue outside prizepool.*");
    assert!(error.to_string().contains("ACCESS_REFUSED"), "{error}");
}
