//! etcd's v3 JSON gateway (`/v3/kv/...` on the client URL, plain HTTP on loopback as the harness
//! starts it): the current revision, compaction, and reads at an old revision. For drills that
//! need the history a watch would resume from to be gone (etcdctl is not built).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Value, json};

use crate::controlplane::Environment;
use crate::error::{Error, Result};

impl Environment {
    async fn etcd_post(&self, path: &str, body: &Value) -> Result<(u16, Value)> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(std::time::Duration::from_secs(30))
            .build()?;
        let response = http
            .post(format!("{}{path}", self.etcd_url()))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        let value = serde_json::from_str(&text)
            .map_err(|e| Error::Scenario(format!("etcd {path} answered {status} with non-JSON {text:?}: {e}")))?;
        Ok((status, value))
    }

    /// etcd's current revision (shared by every cluster of the environment).
    ///
    /// # Errors
    /// When etcd does not answer or answers without a revision.
    pub async fn etcd_revision(&self) -> Result<i64> {
        let key = STANDARD.encode("/");
        let (status, v) = self
            .etcd_post("/v3/kv/range", &json!({"key": key, "count_only": true}))
            .await?;
        revision_of(&v).ok_or_else(|| Error::Scenario(format!("etcd range answered {status}: {v}")))
    }

    /// Compacts etcd's history up to `revision` (physically: the call returns once the old
    /// revisions are gone). Every watch of the shared etcd that would resume from before it can
    /// no longer be served from etcd.
    ///
    /// # Errors
    /// When etcd refuses (for example a revision already compacted).
    pub async fn etcd_compact(&self, revision: i64) -> Result<()> {
        let (status, v) = self
            .etcd_post(
                "/v3/kv/compaction",
                &json!({"revision": revision.to_string(), "physical": true}),
            )
            .await?;
        if status == 200 && v.get("error").is_none() {
            tracing::info!(revision, "compacted etcd");
            Ok(())
        } else {
            Err(Error::Scenario(format!(
                "etcd compaction at {revision} answered {status}: {v}"
            )))
        }
    }

    /// Reads the key space at `revision`: `Ok(None)` when etcd still has it, `Ok(Some(message))`
    /// with etcd's error when it does not (for example "required revision has been compacted").
    ///
    /// # Errors
    /// When etcd cannot be reached.
    pub async fn etcd_read_at(&self, revision: i64) -> Result<Option<String>> {
        let key = STANDARD.encode("/");
        let (_, v) = self
            .etcd_post(
                "/v3/kv/range",
                &json!({"key": key, "count_only": true, "revision": revision.to_string()}),
            )
            .await?;
        Ok(v.get("error")
            .or_else(|| v.get("message"))
            .and_then(Value::as_str)
            .map(str::to_owned))
    }
}

/// `header.revision`, which the gateway encodes as a string (int64 in proto3 JSON).
fn revision_of(v: &Value) -> Option<i64> {
    let r = &v["header"]["revision"];
    r.as_str().and_then(|s| s.parse().ok()).or_else(|| r.as_i64())
}
