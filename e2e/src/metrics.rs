//! A small parser for the Prometheus text exposition format (and OpenMetrics text), enough for
//! tests to read values off `/metrics`.

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric name, including any `_total`, `_bucket`, `_sum`, `_count` suffix.
    pub name: String,
    /// The labels, in the order they appear, with escapes resolved.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of a label, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| label == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Every well-formed sample of an exposition; comments, blank lines and malformed lines are
/// skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

/// The value of the first sample named `name` that carries all of `labels` (it may carry
/// more), or `None` if there is none.
///
/// ```
/// let text = "# TYPE requests_total counter\nrequests_total{code=\"200\",path=\"/\"} 3\n";
/// let value = replicator_e2e::metric_value(text, "requests_total", &[("code", "200")]);
/// assert_eq!(value, Some(3.0));
/// ```
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter_map(parse_line)
        .find(|sample| sample.name == name && labels.iter().all(|(key, value)| sample.label(key) == Some(*value)))
        .map(|sample| sample.value)
}

/// The value of counter `name` (its sample name, `..._total`) for `labels`: the first matching
/// sample's value, `Some(0.0)` when the exposition declares the counter (a `# TYPE` line for
/// `name` or, as OpenMetrics writes it, `name` without `_total`) but has no sample with those
/// labels yet (a labelled counter appears on its first increment), and `None` when it does not
/// declare it at all: a metric that is missing is not read as zero.
///
/// ```
/// let text = "# TYPE writes counter\nwrites_total{op=\"create\"} 3\n";
/// assert_eq!(replicator_e2e::metrics::counter_value(text, "writes_total", &[("op", "create")]), Some(3.0));
/// assert_eq!(replicator_e2e::metrics::counter_value(text, "writes_total", &[("op", "delete")]), Some(0.0));
/// assert_eq!(replicator_e2e::metrics::counter_value(text, "deletes_total", &[]), None);
/// ```
pub fn counter_value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let family = name.strip_suffix("_total").unwrap_or(name);
    let declared = text.lines().any(|line| {
        let mut words = line.split_whitespace();
        words.next() == Some("#")
            && words.next() == Some("TYPE")
            && words.next().is_some_and(|n| n == name || n == family)
    });
    metric_value(text, name, labels).or(declared.then_some(0.0))
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, remainder) = parse_labels(after_brace)?;
        labels = parsed;
        rest = remainder;
    }
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Parses `a="x",b="y"}` (the opening brace already consumed); returns the labels and the text
/// after the closing brace.
fn parse_labels(mut text: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        text = text.trim_start_matches(|c: char| c == ',' || c.is_whitespace());
        if let Some(rest) = text.strip_prefix('}') {
            return Some((labels, rest));
        }
        let eq = text.find('=')?;
        let key = text[..eq].trim();
        if key.is_empty() {
            return None;
        }
        text = text[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = text.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, other) => value.push(other),
            }
        };
        labels.push((key.to_owned(), value));
        text = &text[end + 1..];
    }
}

fn parse_value(token: &str) -> Option<f64> {
    match token {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        other => other.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP replicator_objects_total Objects mirrored.
# TYPE replicator_objects_total counter
replicator_objects_total{kind="Service",location="cell-a"} 7
replicator_objects_total{kind="Service",location="cell-b"} 2 1712345678000
replicator_up 1
weird{path="a\"b\\c\nd", empty=""} 4.5e1
latency_bucket{le="+Inf"} 12
gauge_inf +Inf
not a sample line
"#;

    #[test]
    fn finds_by_name_and_label_subset() {
        assert_eq!(
            metric_value(TEXT, "replicator_objects_total", &[("location", "cell-b")]),
            Some(2.0)
        );
        assert_eq!(metric_value(TEXT, "replicator_objects_total", &[]), Some(7.0));
        assert_eq!(metric_value(TEXT, "replicator_up", &[]), Some(1.0));
        assert_eq!(
            metric_value(TEXT, "replicator_objects_total", &[("location", "cell-c")]),
            None
        );
        assert_eq!(metric_value(TEXT, "replicator_objects", &[]), None);
    }

    #[test]
    fn resolves_escapes_and_special_values() {
        assert_eq!(
            metric_value(TEXT, "weird", &[("path", "a\"b\\c\nd"), ("empty", "")]),
            Some(45.0)
        );
        assert_eq!(metric_value(TEXT, "latency_bucket", &[("le", "+Inf")]), Some(12.0));
        assert_eq!(metric_value(TEXT, "gauge_inf", &[]), Some(f64::INFINITY));
    }

    #[test]
    fn parse_skips_comments_and_garbage() {
        let samples = parse(TEXT);
        assert_eq!(samples.len(), 6);
        assert_eq!(samples[0].label("kind"), Some("Service"));
    }
}
