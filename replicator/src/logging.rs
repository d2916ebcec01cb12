//! JSON log lines with the fields of the spans in scope flattened to the top level.
//!
//! Per-object work runs in spans carrying `cluster` (`cell` or `hub`: where the named object
//! lives), `kind`, `namespace` and `name` (see `sync`, `sweep`, `membership`); per-kind work in
//! spans carrying `cluster` and `kind`. [`FlatJson`] puts those fields on every line, beside the
//! event's own, so a log pipeline can select an object's lines by plain top-level keys.
//!
//! `tracing-subscriber`'s JSON formatter nests span fields under `span`/`spans`, and
//! `json-subscriber`'s flattening overwrites a span field called `name` with the span's name and
//! may repeat a key, so this formatter builds the line from `tracing-subscriber`'s own stored
//! span fields ([`JsonFields`]) and writes each key once.

use std::fmt;

use serde_json::{Map, Value};
use tracing::{Event, Subscriber};
use tracing_subscriber::{
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields,
        format::{JsonFields, Writer},
        time::{FormatTime, SystemTime},
    },
    registry::LookupSpan,
};

/// The keys every line starts with; a span or event field of the same name is dropped.
const FIXED_KEYS: [&str; 3] = ["timestamp", "level", "target"];

/// Formats an event as one JSON object on one line:
/// `{"timestamp":"<RFC 3339>","level":"INFO","target":"<module>", <fields>}` where `<fields>`
/// are the fields of every span in the event's scope (outermost first, an inner span's field
/// replacing an outer one of the same name), then the event's own fields (`message` and the
/// rest, replacing a span field of the same name). Every key appears once. Events forwarded
/// from the `log` crate take their target from `log.target`; the other `log.*` fields are
/// dropped. Use with [`JsonFields`] as the field formatter (span fields are stored as JSON).
#[derive(Clone, Copy, Debug, Default)]
pub struct FlatJson;

/// Merges the JSON object `text` (fields as [`JsonFields`] stores them) into `into`.
fn merge(into: &mut Map<String, Value>, text: &str) {
    if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(text) {
        into.extend(fields);
    }
}

impl<S> FormatEvent<S, JsonFields> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, JsonFields>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut fields = Map::new();
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                if let Some(stored) = span.extensions().get::<FormattedFields<JsonFields>>() {
                    merge(&mut fields, &stored.fields);
                }
            }
        }
        let mut own = String::new();
        ctx.format_fields(Writer::new(&mut own), event)?;
        merge(&mut fields, &own);

        let meta = event.metadata();
        let target = match fields.remove("log.target") {
            Some(Value::String(t)) => t,
            _ => meta.target().to_owned(),
        };
        fields.retain(|k, _| !k.starts_with("log.") && !FIXED_KEYS.contains(&k.as_str()));
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;

        let mut line = String::with_capacity(256);
        line.push_str("{\"timestamp\":");
        line.push_str(&Value::from(timestamp).to_string());
        line.push_str(",\"level\":");
        line.push_str(&Value::from(meta.level().as_str()).to_string());
        line.push_str(",\"target\":");
        line.push_str(&Value::from(target).to_string());
        for (key, value) in fields {
            line.push(',');
            line.push_str(&Value::from(key).to_string());
            line.push(':');
            line.push_str(&value.to_string());
        }
        line.push('}');
        writeln!(writer, "{line}")
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        sync::{Arc, Mutex},
    };

    use super::*;

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn lines(f: impl FnOnce()) -> Vec<Map<String, Value>> {
        let capture = Capture::default();
        let writer = capture.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| match serde_json::from_str(l) {
                Ok(Value::Object(m)) => m,
                other => panic!("not a JSON object: {l}: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn span_fields_are_top_level_and_keys_unique() {
        let out = lines(|| {
            let outer = tracing::info_span!("sources", cluster = "cell", kind = "NetworkInterface", location = "dfw");
            let _o = outer.enter();
            tracing::info!(objects = 3, "cell list complete");
            let inner = tracing::info_span!("sync", cluster = "cell", namespace = "ns-1", name = "web-0");
            let _i = inner.enter();
            tracing::warn!(error = "boom", kind = "Override", "sync \"failed\"");
        });
        assert_eq!(out.len(), 2);
        let first = &out[0];
        assert_eq!(first["cluster"], "cell");
        assert_eq!(first["kind"], "NetworkInterface");
        assert_eq!(first["location"], "dfw");
        assert_eq!(first["objects"], 3);
        assert_eq!(first["message"], "cell list complete");
        assert_eq!(first["level"], "INFO");
        assert_eq!(first["target"], "replicator::logging::tests");
        assert!(first["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')));
        let second = &out[1];
        assert_eq!(second["name"], "web-0", "a span field called name is the object's name");
        assert_eq!(second["namespace"], "ns-1");
        assert_eq!(second["kind"], "Override", "the event's field wins");
        assert_eq!(second["message"], "sync \"failed\"");
        assert_eq!(second["level"], "WARN");
    }

    #[test]
    fn fields_named_like_fixed_keys_never_repeat_them() {
        let capture = Capture::default();
        let writer = capture.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("s", level = "span-level", target = "x");
            let _g = span.enter();
            tracing::info!(timestamp = 5, "no span");
        });
        let text = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.matches("\"level\"").count(), 1, "{text}");
        assert_eq!(text.matches("\"target\"").count(), 1, "{text}");
        assert_eq!(text.matches("\"timestamp\"").count(), 1, "{text}");
        assert!(text.contains("\"level\":\"INFO\""), "{text}");
    }
}
