//! The Prometheus text exposition format (0.0.4, and the OpenMetrics 1.0 text that
//! `prometheus-client` writes) read into samples, and quantiles estimated from histogram buckets.
//!
//! A small parser of our own: the crates that exist either split label pairs on `,` and `=`
//! (wrong as soon as a label value holds one of them) or carry a copyleft licence. Only what
//! `replicator status` needs is kept: sample name, labels and value. `# HELP`, `# TYPE`,
//! `# UNIT`, `# EOF` and comments are skipped; timestamps and exemplars are checked and dropped.

use std::collections::BTreeMap;

/// One sample line, `name{label="value",...} value [timestamp] [# exemplar]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Metric name including any suffix (`_bucket`, `_total`, ...).
    pub name: String,
    /// Label names to unescaped values.
    pub labels: BTreeMap<String, String>,
    /// The value (`+Inf`, `-Inf` and `NaN` included).
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }
}

/// A line that is not valid exposition text.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}: {text:?}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: &'static str,
    /// The line, cut to 200 characters.
    pub text: String,
}

/// Parses exposition text into its samples, in input order.
///
/// # Errors
/// [`ParseError`] for the first malformed sample line (like Prometheus, which fails a scrape on
/// a parse error rather than keeping part of it).
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    let mut samples = Vec::new();
    for (index, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let sample = parse_sample(line).map_err(|message| ParseError {
            line: index + 1,
            message,
            text: raw.chars().take(200).collect(),
        })?;
        samples.push(sample);
    }
    Ok(samples)
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    is_name_start(c) || c.is_ascii_digit()
}

fn is_label_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_label_char(c: char) -> bool {
    is_label_start(c) || c.is_ascii_digit()
}

/// A cursor over one line.
struct Cursor<'a> {
    rest: &'a str,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<char> {
        self.rest.chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.rest = &self.rest[c.len_utf8()..];
        Some(c)
    }

    fn skip_blanks(&mut self) -> bool {
        let before = self.rest.len();
        self.rest = self.rest.trim_start_matches([' ', '\t']);
        self.rest.len() != before
    }

    fn take_while(&mut self, start: fn(char) -> bool, more: fn(char) -> bool) -> Option<&'a str> {
        if !self.peek().is_some_and(start) {
            return None;
        }
        let end = self
            .rest
            .char_indices()
            .find(|&(_, c)| !more(c))
            .map_or(self.rest.len(), |(i, _)| i);
        let (taken, rest) = self.rest.split_at(end);
        self.rest = rest;
        Some(taken)
    }

    fn token(&mut self) -> &'a str {
        let end = self.rest.find([' ', '\t']).unwrap_or(self.rest.len());
        let (taken, rest) = self.rest.split_at(end);
        self.rest = rest;
        taken
    }
}

fn parse_sample(line: &str) -> Result<Sample, &'static str> {
    let mut cur = Cursor { rest: line };
    let name = cur
        .take_while(is_name_start, is_name_char)
        .ok_or("expected a metric name")?
        .to_owned();
    let mut labels = BTreeMap::new();
    cur.skip_blanks();
    if cur.peek() == Some('{') {
        cur.bump();
        loop {
            cur.skip_blanks();
            if cur.peek() == Some('}') {
                cur.bump();
                break;
            }
            let label = cur
                .take_while(is_label_start, is_label_char)
                .ok_or("expected a label name")?;
            cur.skip_blanks();
            if cur.bump() != Some('=') {
                return Err("expected '=' after a label name");
            }
            cur.skip_blanks();
            if cur.bump() != Some('"') {
                return Err("expected '\"' opening a label value");
            }
            let value = label_value(&mut cur)?;
            if labels.insert(label.to_owned(), value).is_some() {
                return Err("duplicate label name");
            }
            cur.skip_blanks();
            match cur.bump() {
                Some(',') => {}
                Some('}') => break,
                _ => return Err("expected ',' or '}' after a label value"),
            }
        }
        cur.skip_blanks();
    }
    let value = parse_float(cur.token()).ok_or("expected a number as the value")?;
    cur.skip_blanks();
    if !cur.rest.is_empty() && !cur.rest.starts_with('#') {
        parse_float(cur.token()).ok_or("expected a timestamp or an exemplar after the value")?;
        cur.skip_blanks();
        if !cur.rest.is_empty() && !cur.rest.starts_with('#') {
            return Err("unexpected text after the timestamp");
        }
    }
    Ok(Sample { name, labels, value })
}

/// Reads a label value up to its closing quote, unescaping `\\`, `\"` and `\n`.
fn label_value(cur: &mut Cursor<'_>) -> Result<String, &'static str> {
    let mut value = String::new();
    loop {
        match cur.bump() {
            None => return Err("unterminated label value"),
            Some('"') => return Ok(value),
            Some('\\') => match cur.bump() {
                Some('\\') => value.push('\\'),
                Some('"') => value.push('"'),
                Some('n') => value.push('\n'),
                _ => return Err("invalid escape in a label value (only \\\\, \\\" and \\n)"),
            },
            Some(c) => value.push(c),
        }
    }
}

/// A Go-style float: decimal or exponent notation, `+Inf`, `-Inf`, `NaN` (any case).
fn parse_float(token: &str) -> Option<f64> {
    if token.is_empty() {
        return None;
    }
    match token.to_ascii_lowercase().as_str() {
        "+inf" | "inf" => Some(f64::INFINITY),
        "-inf" => Some(f64::NEG_INFINITY),
        "nan" => Some(f64::NAN),
        // Rust also reads "infinity"; the format does not have it.
        lower if lower.contains("infinity") => None,
        _ => token.parse().ok(),
    }
}

/// One cumulative histogram bucket: observations `<= le`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    /// Upper bound (`le`), `+Inf` for the last bucket.
    pub le: f64,
    /// Cumulative count of observations at or below `le`.
    pub count: f64,
}

/// The buckets of histogram `name` (series `<name>_bucket`) whose labels include every pair of
/// `selector`, summed per `le` across the matching series (PromQL's `sum by (le)`, so several
/// processes or scrapes merge into one histogram). Sorted by `le`; series with an unparsable
/// `le` are skipped.
pub fn buckets(samples: &[Sample], name: &str, selector: &[(&str, &str)]) -> Vec<Bucket> {
    let series = format!("{name}_bucket");
    let mut sums: Vec<Bucket> = Vec::new();
    for s in samples.iter().filter(|s| s.name == series) {
        if !selector.iter().all(|(k, v)| s.label(k) == Some(*v)) {
            continue;
        }
        let Some(le) = s.label("le").and_then(parse_float) else {
            continue;
        };
        match sums.iter_mut().find(|b| b.le == le) {
            Some(b) => b.count += s.value,
            None => sums.push(Bucket { le, count: s.value }),
        }
    }
    sums.sort_by(|a, b| a.le.total_cmp(&b.le));
    sums
}

/// The `q`-quantile (0 ≤ q ≤ 1) of a histogram, estimated the way Prometheus'
/// `histogram_quantile` does: find the bucket holding rank `q × observations` and interpolate
/// linearly inside it, the first bucket starting at 0 (or answering its upper bound if that is
/// not positive); a rank in the `+Inf` bucket answers the largest finite upper bound.
/// Counts that decrease with `le` (a scrape racing an observation) are raised to be monotonic.
///
/// `None` where Prometheus answers NaN or ±Inf: `q` outside `[0, 1]` or NaN, no `+Inf` bucket,
/// fewer than two buckets, or no observations. One deliberate difference: the rank search skips
/// empty leading buckets, so `q = 0` answers the lower bound of the first non-empty bucket
/// instead of NaN.
pub fn quantile(q: f64, buckets: &[Bucket]) -> Option<f64> {
    if !(0.0..=1.0).contains(&q) {
        return None;
    }
    let mut sorted: Vec<Bucket> = buckets.to_vec();
    sorted.sort_by(|a, b| a.le.total_cmp(&b.le));
    sorted.dedup_by(|later, earlier| {
        let same = later.le == earlier.le;
        if same {
            earlier.count += later.count;
        }
        same
    });
    let last = sorted.last()?;
    if last.le != f64::INFINITY || sorted.len() < 2 {
        return None;
    }
    let mut highest = 0.0_f64;
    for b in &mut sorted {
        highest = highest.max(b.count);
        b.count = highest;
    }
    let observations = highest;
    if observations <= 0.0 || observations.is_nan() {
        return None;
    }
    let rank = q * observations;
    let finite = sorted.len() - 1;
    let index = sorted[..finite]
        .iter()
        .position(|b| b.count >= rank && b.count > 0.0)
        .unwrap_or(finite);
    if index == finite {
        return Some(sorted[finite - 1].le);
    }
    let bucket = sorted[index];
    if index == 0 && bucket.le <= 0.0 {
        return Some(bucket.le);
    }
    let (start, below) = match index {
        0 => (0.0, 0.0),
        i => (sorted[i - 1].le, sorted[i - 1].count),
    };
    let in_bucket = bucket.count - below;
    Some(start + (bucket.le - start) * ((rank - below) / in_bucket))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(pairs: &[(f64, f64)]) -> Vec<Bucket> {
        pairs.iter().map(|&(le, count)| Bucket { le, count }).collect()
    }

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-9)
    }

    #[test]
    fn parses_what_prometheus_client_writes() {
        let text = "# HELP replicator_propagation_lag_seconds Seconds from a source change.\n\
# TYPE replicator_propagation_lag_seconds histogram\n\
replicator_propagation_lag_seconds_sum{kind=\"NetworkInterface\",location=\"dfw\"} 0.25\n\
replicator_propagation_lag_seconds_count{kind=\"NetworkInterface\",location=\"dfw\"} 3\n\
replicator_propagation_lag_seconds_bucket{le=\"0.001\",kind=\"NetworkInterface\",location=\"dfw\"} 0\n\
replicator_propagation_lag_seconds_bucket{le=\"+Inf\",kind=\"NetworkInterface\",location=\"dfw\"} 3\n\
# TYPE replicator_leader gauge\n\
replicator_leader{location=\"dfw\"} 1\n\
replicator_last_sync_timestamp_seconds{kind=\"Subnet\",location=\"dfw\"} 1764374400.5\n\
# EOF\n";
        let samples = parse(text).unwrap();
        assert_eq!(samples.len(), 6);
        assert_eq!(samples[0].name, "replicator_propagation_lag_seconds_sum");
        assert_eq!(samples[0].label("kind"), Some("NetworkInterface"));
        assert_eq!(samples[0].value, 0.25);
        assert_eq!(samples[3].label("le"), Some("+Inf"));
        assert_eq!(samples[4].labels.len(), 1);
        assert_eq!(samples[5].value, 1_764_374_400.5);
    }

    #[test]
    fn label_values_may_hold_commas_equals_quotes_and_escapes() {
        let samples = parse(r#"m{a="x,y=z",b="say \"hi\"",c="back\\slash",d="two\nlines",} 1"#).unwrap();
        let s = &samples[0];
        assert_eq!(s.label("a"), Some("x,y=z"));
        assert_eq!(s.label("b"), Some("say \"hi\""));
        assert_eq!(s.label("c"), Some("back\\slash"));
        assert_eq!(s.label("d"), Some("two\nlines"));
        assert_eq!(s.value, 1.0);
    }

    #[test]
    fn values_timestamps_exemplars_and_blanks() {
        let samples =
            parse("  a 1e3\nb -Inf\nc NaN 1700000000000\nd{x=\"1\"}\t7 1700000000.5 # {trace=\"t\"} 1\ne 2 # {} 1\n\n")
                .unwrap();
        assert_eq!(samples[0].value, 1000.0);
        assert_eq!(samples[1].value, f64::NEG_INFINITY);
        assert!(samples[2].value.is_nan());
        assert_eq!(samples[3].value, 7.0);
        assert_eq!(samples[4].value, 2.0);
    }

    #[test]
    fn malformed_lines_name_their_line_and_fault() {
        let cases = [
            ("ok 1\n{a=\"b\"} 1", 2, "expected a metric name"),
            ("m{a=b} 1", 1, "expected '\"' opening a label value"),
            ("m{a=\"b} 1", 1, "unterminated label value"),
            ("m{a=\"b\" c=\"d\"} 1", 1, "expected ',' or '}' after a label value"),
            (
                "m{a=\"\\t\"} 1",
                1,
                "invalid escape in a label value (only \\\\, \\\" and \\n)",
            ),
            ("m{a=\"1\",a=\"2\"} 1", 1, "duplicate label name"),
            ("m one", 1, "expected a number as the value"),
            ("m", 1, "expected a number as the value"),
            ("m 1 soon", 1, "expected a timestamp or an exemplar after the value"),
            ("m 1 2 3", 1, "unexpected text after the timestamp"),
            ("m Infinity", 1, "expected a number as the value"),
        ];
        for (text, line, message) in cases {
            let err = parse(text).unwrap_err();
            assert_eq!((err.line, err.message), (line, message), "{text:?}");
        }
    }

    #[test]
    fn buckets_select_by_labels_and_sum_per_le() {
        let text = "h_bucket{k=\"a\",le=\"1\"} 1\nh_bucket{k=\"a\",le=\"+Inf\"} 2\n\
h_bucket{k=\"a\",le=\"1\"} 3\nh_bucket{k=\"a\",le=\"+Inf\"} 5\n\
h_bucket{k=\"b\",le=\"1\"} 100\nh_bucket{k=\"a\",le=\"x\"} 9\nh_count{k=\"a\"} 7\n";
        let samples = parse(text).unwrap();
        assert_eq!(
            buckets(&samples, "h", &[("k", "a")]),
            b(&[(1.0, 4.0), (f64::INFINITY, 7.0)])
        );
        assert!(buckets(&samples, "h", &[("k", "c")]).is_empty());
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket() {
        // 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, 0.4].
        let h = b(&[(0.1, 4.0), (0.2, 8.0), (0.4, 10.0), (f64::INFINITY, 10.0)]);
        assert!(close(quantile(0.5, &h), 0.125)); // rank 5: 1/4 into (0.1, 0.2]
        assert!(close(quantile(0.2, &h), 0.05)); // rank 2: half of the first bucket, from 0
        assert!(close(quantile(0.95, &h), 0.35)); // rank 9.5: 3/4 into (0.2, 0.4]
        assert!(close(quantile(1.0, &h), 0.4));
        assert!(close(quantile(0.0, &h), 0.0));
    }

    #[test]
    fn a_rank_in_the_inf_bucket_answers_the_largest_finite_bound() {
        let h = b(&[(0.1, 1.0), (0.2, 2.0), (f64::INFINITY, 10.0)]);
        assert!(close(quantile(0.5, &h), 0.2));
        assert!(close(quantile(0.99, &h), 0.2));
    }

    #[test]
    fn a_first_bucket_with_a_non_positive_bound_answers_that_bound() {
        let h = b(&[(-1.0, 5.0), (1.0, 10.0), (f64::INFINITY, 10.0)]);
        assert!(close(quantile(0.3, &h), -1.0));
        let h = b(&[(0.0, 5.0), (1.0, 10.0), (f64::INFINITY, 10.0)]);
        assert!(close(quantile(0.3, &h), 0.0));
        assert!(close(quantile(0.75, &h), 0.5));
    }

    #[test]
    fn undefined_cases_answer_none() {
        let h = b(&[(0.1, 1.0), (f64::INFINITY, 2.0)]);
        assert_eq!(quantile(-0.1, &h), None);
        assert_eq!(quantile(1.1, &h), None);
        assert_eq!(quantile(f64::NAN, &h), None);
        assert_eq!(quantile(0.5, &b(&[(0.1, 1.0), (0.2, 2.0)])), None, "no +Inf bucket");
        assert_eq!(quantile(0.5, &b(&[(f64::INFINITY, 2.0)])), None, "only +Inf");
        assert_eq!(quantile(0.5, &[]), None);
        assert_eq!(
            quantile(0.5, &b(&[(0.1, 0.0), (f64::INFINITY, 0.0)])),
            None,
            "no observations"
        );
    }

    #[test]
    fn unsorted_duplicate_and_non_monotonic_buckets_are_repaired() {
        let h = b(&[(f64::INFINITY, 10.0), (0.2, 8.0), (0.1, 4.0), (0.4, 10.0)]);
        assert!(close(quantile(0.5, &h), 0.125), "sorted by le");
        // A scrape racing an observation: 0.2 reads lower than 0.1.
        let h = b(&[(0.1, 4.0), (0.2, 3.0), (0.4, 10.0), (f64::INFINITY, 10.0)]);
        assert!(close(quantile(0.4, &h), 0.1), "0.2 raised to 4: rank 4 ends bucket 0.1");
        let h = b(&[(0.1, 2.0), (0.1, 2.0), (f64::INFINITY, 4.0)]);
        assert!(close(quantile(0.5, &h), 0.05), "duplicate le summed: 4 of 4 at 0.1");
    }

    #[test]
    fn empty_leading_buckets_are_skipped() {
        let h = b(&[(0.1, 0.0), (0.2, 0.0), (0.4, 4.0), (f64::INFINITY, 4.0)]);
        assert!(close(quantile(0.0, &h), 0.2));
        assert!(close(quantile(0.5, &h), 0.3));
    }
}
