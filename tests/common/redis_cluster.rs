//! A private Redis Cluster for tests: masters (and replicas) on free ports,
//! stopped and removed when dropped, and the operations a running cluster
//! goes through: moving a slot live, a manual failover, a master killed.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use super::{redis_server, KillOnDrop};

/// One node of a [`RedisCluster`].
pub struct Node {
    pub port: u16,
    pub process: Option<KillOnDrop>,
    /// Its directory and options, to start it again after a kill.
    dir: std::path::PathBuf,
    options: Vec<String>,
}

/// Cluster-mode redis-servers, stopped when dropped (even on panic).
pub struct RedisCluster {
    pub nodes: Vec<Node>,
    dir: std::path::PathBuf,
    /// `REDIS_URL` for the fleet: every master.
    pub url: String,
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        // Stop the nodes before removing their files.
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A port whose cluster bus port (port + 10000) is free too.
fn free_port() -> u16 {
    loop {
        let p = super::free_port();
        if p < 55000 && std::net::TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
            return p;
        }
    }
}

fn start_node(port: u16, dir: &std::path::Path, options: &[String]) -> KillOnDrop {
    let options: Vec<&str> = options.iter().map(String::as_str).collect();
    redis_server(port, dir, &options)
}

/// `redis-cli -p port args...`, its output as text.
pub fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each, with AOF and
    /// `appendfsync always` (the zero-loss setting of `docs/design.md`) and
    /// a short node timeout, so a dead master is replaced within seconds.
    pub async fn start(masters: usize, replicas: usize) -> Self {
        let dir = std::env::temp_dir().join(format!("pp-cluster-{}", ulid::Ulid::new()));
        std::fs::create_dir_all(&dir).unwrap();
        // A free port can be taken by another test's server between the
        // probe and our node's start (our node then exits, and the port
        // answers as a server without cluster mode): start again on
        // other ports until every node is ours and in cluster mode.
        let mut attempt = 0;
        let (ports, nodes) = loop {
            attempt += 1;
            let ports: Vec<u16> = (0..masters * (1 + replicas)).map(|_| free_port()).collect();
            let mut nodes: Vec<Node> = Vec::new();
            for port in &ports {
                let node_dir = dir.join(port.to_string());
                std::fs::create_dir_all(&node_dir).unwrap();
                // The bus port is named too, so it cannot land on a port taken meanwhile.
                let bus = super::free_port().to_string();
                let options: Vec<String> = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",
                    bus.as_str(),
                    "--cluster-node-timeout",
                    "2000",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                    // A replica syncs at once, not 5 s after it asks: one
                    // that has not synced cannot replace its master.
                    "--repl-diskless-sync-delay",
                    "0",
                    // The masters that are up serve their slots while a
                    // lost one is replaced (docs/operations.md).
                    "--cluster-require-full-coverage",
                    "no",
                ]
                .map(str::to_owned)
                .to_vec();
                let process = start_node(*port, &node_dir, &options);
                nodes.push(Node {
                    port: *port,
                    process: Some(process),
                    dir: node_dir,
                    options,
                });
            }
            for port in &ports {
                let deadline = Instant::now() + Duration::from_secs(30);
                while std::net::TcpStream::connect(("127.0.0.1", *port)).is_err() {
                    assert!(Instant::now() < deadline, "node {port} did not start");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let ours = nodes.iter_mut().all(|n| {
                n.process
                    .as_mut()
                    .is_some_and(|p| matches!(p.0.try_wait(), Ok(None)))
                    && cli(n.port, &["CLUSTER", "INFO"]).contains("cluster_state")
            });
            if ours {
                break (ports, nodes);
            }
            assert!(
                attempt < 5,
                "no free ports for a cluster after {attempt} tries"
            );
        };
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self {
            url: ports[..masters]
                .iter()
                .map(|p| format!("redis://127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(","),
            nodes,
            dir,
        };
        cluster.wait_ok().await;
        cluster.wait_synced().await;
        cluster
    }

    /// Waits until every live replica has synced with its master: a
    /// replica that has not cannot be promoted when its master dies.
    pub async fn wait_synced(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in self.nodes.iter().filter(|n| n.process.is_some()) {
            loop {
                let info = cli(node.port, &["info", "replication"]);
                if info.contains("role:master") || info.contains("master_link_status:up") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "replica {} not in sync: {info}",
                    node.port
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Waits until every live node says the cluster is up and agrees on
    /// who serves every slot.
    pub async fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for node in self.nodes.iter().filter(|n| n.process.is_some()) {
            loop {
                let info = cli(node.port, &["cluster", "info"]);
                if info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster not ok on {}: {info}",
                    node.port
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// A live node's port (to ask the cluster things).
    fn any_port(&self) -> u16 {
        self.nodes
            .iter()
            .find(|n| n.process.is_some())
            .map(|n| n.port)
            .unwrap()
    }

    /// The slot of `key` (or of its hash tag).
    pub fn slot(&self, key: &str) -> u16 {
        cli(self.any_port(), &["cluster", "keyslot", key])
            .parse()
            .unwrap()
    }

    /// `(node id, port, is master, master id)` of every node, as the
    /// cluster sees it now.
    pub fn topology(&self) -> Vec<(String, u16, bool, String)> {
        cli(self.any_port(), &["cluster", "nodes"])
            .lines()
            .filter(|l| !l.contains("fail"))
            .map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
                (
                    f[0].to_owned(),
                    port,
                    f[2].contains("master"),
                    f[3].to_owned(),
                )
            })
            .collect()
    }

    /// The port of the master serving `slot`.
    pub fn master_of(&self, slot: u16) -> u16 {
        let slots = cli(self.any_port(), &["cluster", "nodes"]);
        for line in slots.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            for range in &f[8..] {
                if range.starts_with('[') {
                    continue;
                }
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                let (lo, hi): (u16, u16) = (lo.parse().unwrap(), hi.parse().unwrap());
                if (lo..=hi).contains(&slot) {
                    return f[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
                }
            }
        }
        panic!("no master serves slot {slot}: {slots}");
    }

    fn id_of(&self, port: u16) -> String {
        cli(port, &["cluster", "myid"])
    }

    /// Moves `slot` to the master on port `to` while it serves traffic: the
    /// importing/migrating dance of the Redis Cluster specification, keys
    /// moved in small `MIGRATE` batches (clients meanwhile get ASK and
    /// TRYAGAIN), then the slot assigned to its new owner on every master.
    pub async fn migrate_slot(&self, slot: u16, to: u16) {
        let from = self.master_of(slot);
        assert_ne!(from, to, "slot {slot} is on {to} already");
        let (from_id, to_id) = (self.id_of(from), self.id_of(to));
        let s = slot.to_string();
        assert_eq!(
            cli(to, &["cluster", "setslot", &s, "importing", &from_id]),
            "OK"
        );
        assert_eq!(
            cli(from, &["cluster", "setslot", &s, "migrating", &to_id]),
            "OK"
        );
        loop {
            let keys = cli(from, &["cluster", "getkeysinslot", &s, "10"]);
            if keys.is_empty() {
                break;
            }
            let mut args = vec![
                "migrate".to_owned(),
                "127.0.0.1".to_owned(),
                to.to_string(),
                String::new(),
                "0".to_owned(),
                "5000".to_owned(),
                "keys".to_owned(),
            ];
            args.extend(keys.lines().map(str::to_owned));
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = cli(from, &refs);
            assert!(out == "OK" || out == "NOKEY", "migrate: {out}");
            // Let traffic meet the half-moved slot.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for (_, port, master, _) in self.topology() {
            if master {
                assert_eq!(cli(port, &["cluster", "setslot", &s, "node", &to_id]), "OK");
            }
        }
    }

    /// The port of a replica of the master on `master`.
    pub fn replica_of(&self, master: u16) -> u16 {
        let id = self.id_of(master);
        self.topology()
            .into_iter()
            .find(|(_, _, is_master, of)| !is_master && *of == id)
            .map(|(_, port, _, _)| port)
            .unwrap_or_else(|| panic!("no replica of {master}"))
    }

    /// A manual failover: the replica on `replica` takes over from its
    /// master once it has every write (`CLUSTER FAILOVER`, no data lost).
    pub async fn failover(&self, replica: u16) {
        assert_eq!(cli(replica, &["cluster", "failover"]), "OK");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cli(replica, &["role"]).starts_with("master") {
            assert!(Instant::now() < deadline, "{replica} did not take over");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts the node on `port` again (after [`RedisCluster::kill`]) with
    /// its files and options: it reloads its AOF and rejoins the cluster
    /// with the identity in its `nodes.conf`, as a replica if its master
    /// role was taken over meanwhile.
    pub async fn restart(&mut self, port: u16) {
        let node = self.nodes.iter_mut().find(|n| n.port == port).unwrap();
        assert!(node.process.is_none(), "node {port} is running");
        node.process = Some(start_node(port, &node.dir, &node.options));
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "node {port} did not start again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the node on `port` with SIGKILL.
    pub fn kill(&mut self, port: u16) {
        let node = self.nodes.iter_mut().find(|n| n.port == port).unwrap();
        node.process = None; // KillOnDrop sends SIGKILL and reaps it
    }
}
