//! Test support: a cell's sync over mock apiservers (`tower-test`). Compiled for tests only, so its
//! `unwrap`s fail a test, never the product.
#![cfg(test)]

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use kube::{Client, client::Body};
use prometheus_client::registry::Registry;
use serde_json::Value;
use tower_test::mock;

use super::{CellSync, Settings, Writers};
use crate::{cluster::HubHealth, health::Health, metrics::Metrics, rules};

pub type Handle = mock::Handle<Request<Body>, Response<Body>>;

/// A sync of location `dfw` in cell `cell-1` for Networks, with mocks of its cell and its hub.
pub fn fixture() -> (Arc<CellSync>, Writers, Handle, Handle) {
    let (cell, cell_handle) = mock::pair::<Request<Body>, Response<Body>>();
    let (hub, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let networks: Vec<_> = rules::default_rules()
        .into_iter()
        .filter(|r| r.resource.kind == "Network")
        .collect();
    let (sync, writers) = CellSync::new(
        Settings {
            location: "dfw".into(),
            workers: 1,
            echo_bookkeeping: true,
        },
        networks,
        Client::new(cell, "default"),
        Client::new(hub, "default"),
        HubHealth::new(),
        Metrics::register(&mut Registry::default()),
        Health::default(),
    );
    sync.cell_id.set("cell-1".into()).unwrap();
    (sync, writers, cell_handle, handle)
}

/// The next request: its method, path and query, content type and JSON body (`Null` when
/// empty); answered with `status` and `body`.
pub async fn answer(handle: &mut Handle, status: StatusCode, body: Value) -> (Method, String, String, Value) {
    let (request, respond) = tokio::time::timeout(std::time::Duration::from_secs(5), handle.next_request())
        .await
        .expect("a request within 5 s")
        .expect("the client is alive");
    let method = request.method().clone();
    let uri = request.uri().to_string();
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let sent = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    let response = Response::builder()
        .status(status)
        .body(Body::from(serde_json::to_vec(&body).unwrap()))
        .unwrap();
    respond.send_response(response);
    (method, uri, content_type, sent)
}
