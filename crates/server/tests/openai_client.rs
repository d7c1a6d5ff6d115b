//! Runs scripts/openai_client_test.py (the official `openai` Python client) against a live
//! server. Skipped when python3 or the `openai` package is missing, except under CI, where
//! scripts/setup.sh installs it and its absence is a failure.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

fn have_openai() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI: python3 with the openai package is required (scripts/setup.sh installs it)"
        );
        eprintln!("SKIP: python3 -c 'import openai' fails (python3 -m pip install openai)");
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works() {
    let Some(_) = model_path() else { return };
    if !have_openai() {
        return;
    }
    let key = "test-key";
    let srv = start(
        nibble_server::ServerConfig {
            api_key: Some(key.into()),
            ..cfg()
        },
        4096,
    )
    .await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/openai_client_test.py");
    let base = format!("{}/v1", srv.base);
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(180),
        tokio::process::Command::new("python3")
            .arg(&script)
            .arg(&base)
            .arg(key)
            .env("NO_PROXY", "127.0.0.1")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the python client test timed out")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client test failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("client test: ok"), "{stdout}");
    eprintln!("{stdout}");
}
