//! The contract as other languages read it: the JSON Schemas and the
//! AsyncAPI document under `docs/` are what the serde types generate (so
//! they cannot drift), and the Python (pika) and Node (amqplib) examples
//! under `examples/` draw, batch, create and grab a red packet against a
//! real fleet, their replies valid against those schemas.
//!
//! The examples' packages come from PyPI and npm (`scripts/example-tools`,
//! into `target/example-tools`): a registry that cannot be reached fails
//! this test, it never skips.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{path::Path, process::Command};

use common::{pool_toml, TestEnv};
use prizepool::messages::{asyncapi, schema};
use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `path` holds `value` (pretty JSON and a newline), or is rewritten with it
/// under `UPDATE_SCHEMAS=1`. Returns a description of the difference.
fn check_file(path: &Path, value: &Value) -> Option<String> {
    let want = format!("{}\n", serde_json::to_string_pretty(value).unwrap());
    if std::env::var_os("UPDATE_SCHEMAS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, &want).unwrap();
        return None;
    }
    match std::fs::read_to_string(path) {
        Ok(have) if have == want => None,
        Ok(_) => Some(format!("{} differs from the serde types", path.display())),
        Err(e) => Some(format!("{}: {e}", path.display())),
    }
}

#[test]
fn the_schemas_and_the_asyncapi_document_are_what_the_types_generate() {
    let dir = Path::new(ROOT).join("docs/schema");
    let messages = schema::messages();
    let mut problems: Vec<String> = messages
        .iter()
        .filter_map(|m| check_file(&dir.join(schema::file_name(m.name)), &m.schema))
        .collect();
    problems.extend(check_file(
        &Path::new(ROOT).join("docs/asyncapi.json"),
        &asyncapi::document(),
    ));
    // No schema left over from a message that is gone.
    let expected: Vec<String> = messages.iter().map(|m| schema::file_name(m.name)).collect();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if !expected.contains(&name) {
            problems.push(format!("docs/schema/{name} describes no message"));
        }
    }
    assert!(
        problems.is_empty(),
        "{problems:#?}\nrun `UPDATE_SCHEMAS=1 cargo test --test it contract::` and commit the files"
    );
    // Every message the wire carries is there, each `type` a required constant.
    for name in [
        "draw",
        "draw.batch",
        "lottery.grant",
        "redpacket.create",
        "settle",
        "settle.batch",
        "draw_result",
        "draw_result.batch",
        "grant_result",
        "redpacket_result",
        "settle_result",
        "draw.completed",
        "pool.refilled",
        "redpacket.closed",
    ] {
        let m = messages.iter().find(|m| m.name == name).unwrap();
        let alternatives = m.schema["oneOf"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| vec![m.schema.clone()]);
        for s in alternatives {
            assert_eq!(s["properties"]["type"]["const"], name, "{name}");
            assert_eq!(s["required"][0], "type", "{name}");
        }
    }
    // Unknown fields of a request are refused, as the workers refuse them.
    let draw = &messages.iter().find(|m| m.name == "draw").unwrap().schema;
    assert_eq!(draw["additionalProperties"], false);
    assert_eq!(draw["properties"]["count"]["maximum"], 10_000);
}

/// Installs the examples' packages (fails when a registry is unreachable).
fn example_tools() -> std::path::PathBuf {
    let out = Command::new(format!("{ROOT}/scripts/example-tools"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/example-tools failed (are PyPI and npm reachable?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Path::new(ROOT).join("target/example-tools")
}

/// Runs one example against the test's fleet; returns its JSON lines.
async fn run_example(env: &TestEnv, program: &Path, args: &[&Path], node_path: &Path) -> String {
    let out = tokio::process::Command::new(program)
        .args(args)
        .env("AMQP_URL", &env.config.amqp_url)
        .env("POOL", "contract-gift")
        .env("USER_ID", "42")
        .env("SENDER", "7")
        .env("NODE_PATH", node_path)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{args:?} exited {:?}:\n{stdout}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Checks an example's replies: one per step, all ok, each valid against
/// its schema (checked by Python's `jsonschema`, an implementation of its own).
fn check_replies(tools: &Path, lines: &str) {
    let steps: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["draw", "draw.batch", "redpacket.create", "grab"],
        "{lines}"
    );
    assert_eq!(steps[0]["reply"]["type"], "draw_result");
    assert_eq!(
        steps[0]["reply"]["prizes"].as_array().unwrap().len(),
        10,
        "{lines}"
    );
    let batch = steps[1]["reply"]["results"].as_array().unwrap();
    assert_eq!(batch.len(), 3);
    assert!(batch.iter().all(|r| r["status"] == "ok"), "{lines}");
    assert_eq!(steps[2]["reply"]["type"], "redpacket_result");
    assert_eq!(steps[2]["reply"]["count"], 5);
    assert_eq!(steps[3]["reply"]["status"], "ok", "{lines}");
    assert!(
        steps[3]["reply"]["reward"].as_i64().unwrap() >= 1,
        "{lines}"
    );
    let mut validate = Command::new(tools.join("venv/bin/python"))
        .arg(format!("{ROOT}/tests/contract/validate.py"))
        .arg(format!("{ROOT}/docs/schema"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    validate
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let out = validate.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("4 replies match"),
        "{said}"
    );
}

#[tokio::test]
async fn the_python_and_node_examples_draw_batch_create_and_grab_against_the_fleet() {
    let tools = tokio::task::spawn_blocking(example_tools).await.unwrap();
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "contract-gift",
        "max_count = 100",
        &[("c1", &[(0, 900), (2, 100)])],
    ))
    .await;
    // Each example creates a packet of 1,000 coins from sender 7.
    env.fund(7, 2_000).await;
    env.start_fleet().await;
    let python = run_example(
        &env,
        &tools.join("venv/bin/python"),
        &[&Path::new(ROOT).join("examples/python/prizepool_example.py")],
        &tools.join("node/node_modules"),
    )
    .await;
    check_replies(&tools, &python);
    let node = run_example(
        &env,
        Path::new("node"),
        &[&Path::new(ROOT).join("examples/node/prizepool_example.js")],
        &tools.join("node/node_modules"),
    )
    .await;
    check_replies(&tools, &node);
    env.stop_workers().await;
}
