//! Logging: the filter (`--log-level`, `RUST_LOG`), the subscriber, the fatal-error line, and
//! JSON log lines with the fields of the spans in scope flattened to the top level.
//!
//! The filter is `--log-level` when given, else `RUST_LOG` when set and valid, else
//! [`DEFAULT_LOG_FILTER`] ([`choose_filter`]). Lines go to stderr, coloured only when stderr is a
//! terminal (and `NO_COLOR` is unset): a pipe or a file gets no ANSI escapes. A fatal error is
//! one event on [`FATAL_TARGET`], shown whatever the filter, in the chosen format ([`fatal`]).
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

use std::{fmt, io::IsTerminal, str::FromStr};

use serde_json::{Map, Value};
use tracing::{Event, Subscriber, level_filters::LevelFilter};
use tracing_subscriber::{
    EnvFilter, Layer,
    filter::{FilterExt, filter_fn},
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields,
        format::{JsonFields, Writer},
        time::{FormatTime, SystemTime},
    },
    layer::SubscriberExt,
    registry::LookupSpan,
    util::SubscriberInitExt,
};

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines, coloured only when stderr is a terminal.
    Text,
    /// One JSON object per line, span fields (cluster, kind, namespace, name) at the top level;
    /// every line on stderr, the fatal error's included.
    Json,
}

/// The log filter without `--log-level` or `RUST_LOG`. kube's HTTP trace layer
/// (`kube_client::client::builder`) logs an ERROR line for every request that gets no answer, one
/// per retry of every watch: the replicator reports an unreachable hub or cell once per change
/// instead (`HubHealth::monitor`, the cell probe of `outage`).
pub const DEFAULT_LOG_FILTER: &str = "info,kube_runtime=warn,kube_client=warn,kube_client::client::builder=off";

/// Target of the fatal-error line: it passes whatever filter is set.
pub const FATAL_TARGET: &str = "replicator::fatal";

/// The levels a bare directive may name.
const LEVELS: &str = "off, error, warn, info, debug, trace";

/// Checks `--log-level`: a level, or `RUST_LOG`-style directives (`replicator=debug,kube=info`).
/// A bare word that is not a level is refused (tracing would read it as a target at `trace`, and
/// it is nearly always a misspelt level): write `TARGET=LEVEL` instead.
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_log_filter(s: &str) -> Result<String, String> {
    let s = s.trim();
    let forms = format!("a level ({LEVELS}) or directives like replicator=debug,kube=info");
    if s.is_empty() {
        return Err(format!("the log level is empty: give {forms}"));
    }
    for directive in s.split(',').map(str::trim) {
        if !directive.contains(['=', '[']) && LevelFilter::from_str(directive).is_err() {
            return Err(format!(
                "{directive:?} is not a level ({LEVELS}); name a target as TARGET=LEVEL"
            ));
        }
    }
    EnvFilter::try_new(s).map_err(|err| format!("{s:?} is not {forms}: {err}"))?;
    Ok(s.to_owned())
}

/// The filter in force and, when `RUST_LOG` was set but not used for being invalid, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterChoice {
    /// The directives.
    pub directives: String,
    /// Set when `RUST_LOG` held an invalid filter and the default was used instead.
    pub ignored_env: Option<String>,
}

/// The filter: `flag` (`--log-level`, already checked) when given, else `env` (`RUST_LOG`) when
/// set, non-empty and valid, else [`DEFAULT_LOG_FILTER`].
pub fn choose_filter(flag: Option<&str>, env: Option<&str>) -> FilterChoice {
    let chosen = |directives: &str, ignored_env| FilterChoice {
        directives: directives.to_owned(),
        ignored_env,
    };
    if let Some(flag) = flag {
        return chosen(flag, None);
    }
    match env.map(str::trim).filter(|e| !e.is_empty()) {
        None => chosen(DEFAULT_LOG_FILTER, None),
        Some(env) => match EnvFilter::try_new(env) {
            Ok(_) => chosen(env, None),
            Err(err) => chosen(
                DEFAULT_LOG_FILTER,
                Some(format!("RUST_LOG={env:?} is not a valid filter ({err})")),
            ),
        },
    }
}

/// Whether log lines on stderr get ANSI colours: only on a terminal, and not under `NO_COLOR`.
pub fn colour_stderr() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Installs the process's subscriber: `format` lines on stderr, filtered by `directives` (see
/// [`choose_filter`]) except the fatal line ([`FATAL_TARGET`]), which always passes.
///
/// # Errors
/// Invalid directives, or a subscriber already installed.
pub fn init(format: LogFormat, directives: &str) -> Result<(), String> {
    let filter = || -> Result<_, String> {
        let directives = EnvFilter::try_new(directives).map_err(|err| format!("log filter {directives:?}: {err}"))?;
        Ok(directives.or(filter_fn(|meta| meta.target() == FATAL_TARGET)))
    };
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colour_stderr());
    let installed = match format {
        LogFormat::Text => tracing_subscriber::registry()
            .with(layer.with_filter(filter()?))
            .try_init(),
        LogFormat::Json => tracing_subscriber::registry()
            .with(
                layer
                    .fmt_fields(JsonFields::new())
                    .event_format(FlatJson)
                    .with_filter(filter()?),
            )
            .try_init(),
    };
    installed.map_err(|err| format!("cannot install the logger: {err}"))
}

/// `err` and its causes, `outer: inner: ...`, skipping a cause whose text is already in the line
/// (an error that quotes its source would otherwise show it twice).
pub fn error_chain(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let cause = cause.to_string();
        if text.is_empty() {
            text = cause;
        } else if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

/// Logs the error that ends `command` (e.g. `replicator run`): one ERROR line, `<command>
/// failed` with the error and its causes in the `error` field, on [`FATAL_TARGET`] so no filter
/// hides it. Without a subscriber (before logging is set up) the same is written to stderr as
/// `<command>: <error>`.
pub fn fatal(command: &str, err: &anyhow::Error) {
    let error = error_chain(err);
    if tracing::dispatcher::has_been_set() {
        tracing::error!(target: FATAL_TARGET, error = %error, "{command} failed");
    } else {
        eprintln!("{command}: {error}");
    }
}

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

    #[test]
    fn the_flag_wins_over_rust_log_which_wins_over_the_default() {
        let choice = |flag, env| choose_filter(flag, env);
        assert_eq!(
            choice(Some("replicator=debug,kube=info"), Some("warn")).directives,
            "replicator=debug,kube=info"
        );
        assert_eq!(
            choice(Some("debug"), Some("not==valid")).ignored_env,
            None,
            "RUST_LOG unused"
        );
        assert_eq!(choice(None, Some("replicator=trace")).directives, "replicator=trace");
        assert_eq!(choice(None, None).directives, DEFAULT_LOG_FILTER);
        assert_eq!(
            choice(None, Some("  ")).directives,
            DEFAULT_LOG_FILTER,
            "empty is unset"
        );
        let bad = choice(None, Some("replicator=loud"));
        assert_eq!(bad.directives, DEFAULT_LOG_FILTER);
        assert!(
            bad.ignored_env
                .as_deref()
                .is_some_and(|m| m.starts_with("RUST_LOG=\"replicator=loud\" is not a valid filter")),
            "{bad:?}"
        );
    }

    #[test]
    fn log_levels_and_directives_are_checked() {
        assert_eq!(parse_log_filter("debug"), Ok("debug".to_owned()));
        assert_eq!(parse_log_filter(" INFO "), Ok("INFO".to_owned()));
        assert_eq!(
            parse_log_filter("replicator=debug,kube=info"),
            Ok("replicator=debug,kube=info".to_owned())
        );
        assert_eq!(parse_log_filter("warn,replicator::sync=trace").map(|_| ()), Ok(()));
        assert_eq!(
            parse_log_filter("debg"),
            Err(
                "\"debg\" is not a level (off, error, warn, info, debug, trace); name a target as TARGET=LEVEL"
                    .to_owned()
            )
        );
        let bad = parse_log_filter("replicator=loud").unwrap_err();
        assert!(
            bad.starts_with(
                "\"replicator=loud\" is not a level (off, error, warn, info, debug, trace) or directives like"
            ),
            "{bad}"
        );
        assert!(parse_log_filter("").is_err());
    }

    #[test]
    fn an_error_chain_names_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let quoted = anyhow::Error::new(crate::rules::Error::Read {
            path: "/r.yaml".into(),
            source: io,
        });
        assert_eq!(
            error_chain(&quoted),
            "failed to read rules file /r.yaml: No such file or directory (os error 2)"
        );
        let layered = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_chain(&layered), "outer: middle: inner");
    }

    #[test]
    fn the_fatal_line_passes_any_filter() {
        let capture = Capture::default();
        let writer = capture.clone();
        let filter = EnvFilter::new("off").or(filter_fn(|meta| meta.target() == FATAL_TARGET));
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_writer(move || writer.clone())
                .with_ansi(false)
                .fmt_fields(JsonFields::new())
                .event_format(FlatJson)
                .with_filter(filter),
        );
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!("hidden by off");
            tracing::error!(target: FATAL_TARGET, error = "boom: cause", "replicator run failed");
        });
        let text = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert_eq!(lines[0]["message"], "replicator run failed");
        assert_eq!(lines[0]["error"], "boom: cause");
        assert_eq!(lines[0]["level"], "ERROR");
        assert_eq!(lines[0]["target"], FATAL_TARGET);
    }
}
