//! OpenAI-style errors and the JSON body extractor that produces them.
//!
//! Every failure the server answers with, including the ones axum would otherwise answer in plain
//! text (a body that is not JSON, a body over the size limit, an unknown route, a wrong method),
//! is sent as `{"error": {"message", "type", "param", "code"}}` with the matching status, the shape
//! the official clients parse.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;

/// An error answer: HTTP status plus the four OpenAI error fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `rate_limit_error`,
    /// `not_found_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `context_length_exceeded`.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()).filter(|p: &String| !p.is_empty()),
            code: None,
        }
    }

    /// Sets the `code` field.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 429: the request queue is full.
    pub fn queue_full(queue: usize) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the server is busy: all {queue} queue slots are taken; retry later"),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    /// 500: something failed inside the engine.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 503: the engine worker is gone.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("engine_unavailable"),
        }
    }

    /// Any other status with a plain message (404, 405, 413, ...).
    pub fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// The JSON body, `{"error": {...}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// How long a request body may take to arrive (a request extension set by the router; 408
/// beyond it).
#[derive(Debug, Clone, Copy)]
pub struct BodyTimeout(pub std::time::Duration);

impl BodyTimeout {
    /// 60 s: ample for the 8 MiB body limit on any working link.
    pub const DEFAULT: std::time::Duration = std::time::Duration::from_secs(60);
}

/// A JSON request body parsed into `T`; every rejection becomes an [`ApiError`] naming the field
/// at fault (`param`), found with `serde_path_to_error`.
///
/// The `Content-Type` header is not required: llama.cpp's server and curl users often omit it.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // A compressed body would read as "not a JSON object": name the real cause.
        let encoding = req.headers().get(axum::http::header::CONTENT_ENCODING);
        if let Some(enc) = encoding.filter(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity")) {
            return Err(ApiError::status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                format!(
                    "Content-Encoding {:?} is not supported: send the JSON body uncompressed",
                    String::from_utf8_lossy(enc.as_bytes())
                ),
            ));
        }
        // A body that never finishes would hold its connection (and a task) for as long as
        // the client likes: it gets the server's `BodyTimeout`.
        let limit = req
            .extensions()
            .get::<BodyTimeout>()
            .map_or(BodyTimeout::DEFAULT, |t| t.0);
        let read = tokio::time::timeout(limit, Bytes::from_request(req, state));
        let bytes = read
            .await
            .map_err(|_| {
                ApiError::status(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    format!(
                        "the request body did not arrive within {} s",
                        limit.as_secs_f64()
                    ),
                )
            })?
            .map_err(|e| {
                let status = e.status();
                ApiError::status(status, "invalid_request_error", e.body_text())
            })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// Parses a JSON document, mapping syntax and type errors to 400s with the offending path.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            "",
            "the request body is empty; send a JSON object",
        ));
    }
    // serde would read a struct from a JSON array by position: insist on an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::invalid(
            "",
            "the request body must be a JSON object",
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let syntax = inner.is_syntax() || inner.is_eof();
        let what = if syntax {
            "malformed JSON"
        } else {
            "invalid request"
        };
        // serde_path_to_error reports "." for the root; a syntax error has no field to blame.
        let param = if path == "." || syntax {
            String::new()
        } else {
            path
        };
        let message = if param.is_empty() {
            format!("{what}: {inner}")
        } else {
            format!("{what}: {param}: {inner}")
        };
        ApiError::invalid(param, message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct T {
        a: Option<f32>,
        b: Option<Vec<u32>>,
    }

    #[test]
    fn type_errors_name_the_field() {
        let e = parse_json::<T>(br#"{"a": "hot"}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("a"));
        assert!(e.message.contains("invalid type: string"), "{}", e.message);
        let e = parse_json::<T>(br#"{"b": [1, -2]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("b[1]"));
    }

    #[test]
    fn syntax_errors_and_empty_bodies_are_400() {
        let e = parse_json::<T>(br#"{"a": 1"#).unwrap_err();
        assert!(e.message.starts_with("malformed JSON"), "{}", e.message);
        assert_eq!(e.param, None);
        let e = parse_json::<T>(b"  ").unwrap_err();
        assert!(e.message.contains("empty"), "{}", e.message);
        let body = e.body();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(body["error"]["param"].is_null());
    }
}
