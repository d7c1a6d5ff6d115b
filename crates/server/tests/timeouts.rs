//! Slow clients over raw TCP: a request body that stops arriving gets 408, and a connection
//! whose headers never come (or that sends nothing) is closed after the header-read timeout;
//! the server goes on serving others.

mod common;

use common::*;
use std::time::{Duration, Instant};

const CTX: usize = 256;

/// A body that stops arriving gets 408 after the server's body timeout (it held the
/// connection for as long as the client liked); the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408() {
    use std::io::{Read, Write};
    let Some(_) = model_path() else { return };
    let cfg = nibble_server::ServerConfig {
        body_timeout: Duration::from_secs(1),
        ..cfg()
    };
    let srv = start(cfg, CTX).await;
    let addr = srv.base.trim_start_matches("http://").to_owned();
    let (answer, waited) = tokio::task::spawn_blocking(move || {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let head = format!("POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\"");
        c.write_all(head.as_bytes()).unwrap();
        let t = Instant::now();
        let mut answer = vec![0u8; 4096];
        let n = c.read(&mut answer).expect("no answer to a stalled body");
        (String::from_utf8_lossy(&answer[..n]).into_owned(), t.elapsed())
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1 s"), "{answer}");
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
    let (st, _) = get(&srv.base, "/health", None).await;
    assert_eq!(st, 200);
}

/// A client that never finishes its request's headers (slowloris) has its connection closed
/// after the header-read timeout instead of holding it forever; the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_headers_are_cut_off() {
    use std::io::{Read, Write};
    let Some(_) = model_path() else { return };
    let srv = start_with(cfg(), CTX, Duration::from_secs(1)).await;
    let addr = srv.base.trim_start_matches("http://").to_owned();
    // Half a header, nothing at all, and the start of an HTTP/2 preface (this server speaks
    // HTTP/1 only; a version-sniffing builder waited for the preface with no timer).
    let sends: [&[u8]; 3] = [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        b"",
        b"PRI * HTTP/2.0\r\n",
    ];
    for sent in sends {
        let addr = addr.clone();
        let (closed, waited) = tokio::task::spawn_blocking(move || {
            let mut c = std::net::TcpStream::connect(&addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            c.write_all(sent).unwrap();
            let t = Instant::now();
            let mut buf = vec![0u8; 1024];
            // The server ends the connection: EOF, a reset, or an error status.
            let closed = match c.read(&mut buf) {
                Ok(0) | Err(_) => true,
                Ok(n) => {
                    let a = String::from_utf8_lossy(&buf[..n]).into_owned();
                    a.starts_with("HTTP/1.1 408") || a.starts_with("HTTP/1.1 400")
                }
            };
            (closed, t.elapsed())
        })
        .await
        .unwrap();
        assert!(closed, "{sent:?}: the connection was answered otherwise");
        assert!(waited < Duration::from_secs(15), "{sent:?}: {waited:?}");
        if sent.len() != 16 {
            // A header that never ends, or none at all, is waited for the timeout.
            assert!(waited >= Duration::from_millis(900), "{sent:?}: {waited:?}");
        }
    }
    let (st, _) = get(&srv.base, "/health", None).await;
    assert_eq!(st, 200);
}
