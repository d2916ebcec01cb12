//! The chart: lag distributions (replicator, relay, Karmada) as cumulative curves, one panel per
//! object count, drawn with plotters into a PNG.
//!
//! Text needs a font: plotters' `ab_glyph` backend is given one read at run time from the
//! system ([`FONT_CANDIDATES`], or `$REPLICATOR_BENCH_FONT`); no font file is shipped.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use plotters::prelude::*;

use super::Results;

/// TrueType fonts tried in order (Debian's `fonts-dejavu-core` and `fonts-liberation` paths).
pub const FONT_CANDIDATES: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/liberation2/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];
/// The font family name the chart registers its font under.
const FAMILY: &str = "sans-serif";

/// Registers the first readable font of `$REPLICATOR_BENCH_FONT` and [`FONT_CANDIDATES`] once.
///
/// # Errors
/// When none can be read or parsed; the message lists the paths tried.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let result = REGISTERED.get_or_init(|| {
        let mut tried = Vec::new();
        let candidates = std::env::var("REPLICATOR_BENCH_FONT")
            .ok()
            .into_iter()
            .chain(FONT_CANDIDATES.iter().map(|s| (*s).to_owned()));
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                // plotters keeps fonts for the life of the process; the chart is drawn once.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).is_ok() {
                    return Ok(PathBuf::from(path));
                }
            }
            tried.push(path);
        }
        Err(format!(
            "no TrueType font for the chart's text: tried {} (install fonts-dejavu-core, or set REPLICATOR_BENCH_FONT to a .ttf file)",
            tried.join(", ")
        ))
    });
    result.as_ref().map(drop).map_err(|e| anyhow::anyhow!("{e}"))
}

/// One curve: a label, a colour, dashed or not, and its sorted lags.
struct Curve<'a> {
    label: String,
    color: RGBColor,
    dashed: bool,
    lags: &'a [Duration],
}

/// Points of the empirical CDF of `sorted` (lag in ms, percent), at most ~400 of them.
fn cdf(sorted: &[Duration]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    let step = (n / 400).max(1);
    let mut points: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| {
            (
                (sorted[i].as_secs_f64() * 1e3).max(0.1),
                (i + 1) as f64 * 100.0 / n as f64,
            )
        })
        .collect();
    if let Some(last) = sorted.last() {
        points.push(((last.as_secs_f64() * 1e3).max(0.1), 100.0));
    }
    points
}

const PALETTE: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// Draws `lag.png` at `path`.
///
/// # Errors
/// No usable font, or a drawing or encoding error.
pub fn draw(results: &Results, path: &Path) -> anyhow::Result<()> {
    register_font()?;
    let panels = results.counts.len().max(1);
    let root = BitMapBackend::new(path, (1000 * panels as u32, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let areas = root.split_evenly((1, panels));
    for (area, c) in areas.iter().zip(&results.counts) {
        let mut curves = Vec::new();
        for (i, (rep, rel)) in c.replicator.rows.iter().zip(&c.relay.rows).enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            curves.push(Curve {
                label: format!("replicator {}/s", rep.stats.rate),
                color,
                dashed: false,
                lags: &rep.lags,
            });
            curves.push(Curve {
                label: format!("relay {}/s", rel.stats.rate),
                color,
                dashed: true,
                lags: &rel.lags,
            });
        }
        let karmada = c.karmada.all_sorted();
        curves.push(Curve {
            label: format!(
                "Karmada → {} ({}/s)",
                results.options.peer_member, results.options.peer_rate
            ),
            color: RGBColor(214, 39, 40),
            dashed: false,
            lags: &karmada,
        });
        let max_ms = curves
            .iter()
            .filter_map(|c| c.lags.last())
            .map(|d| d.as_secs_f64() * 1e3)
            .fold(10.0, f64::max);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("Propagation lag, {} objects (CDF)", c.objects), (FAMILY, 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d((0.1f64..max_ms * 1.2).log_scale(), 0f64..100f64)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc("lag (ms, log scale)")
            .y_desc("writes propagated (%)")
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 16))
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        for curve in &curves {
            let points = cdf(curve.lags);
            let style = ShapeStyle::from(curve.color).stroke_width(2);
            let color = curve.color;
            let anno = if curve.dashed {
                chart.draw_series(DashedLineSeries::new(points, 6, 4, style))
            } else {
                chart.draw_series(LineSeries::new(points, style))
            }
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            let dashed = curve.dashed;
            anno.label(curve.label.clone()).legend(move |(x, y)| {
                let style = ShapeStyle::from(color).stroke_width(2);
                let end = if dashed { x + 7 } else { x + 18 };
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (end - x, 0)], style)
                    + PathElement::new(if dashed { vec![(11, 0), (18, 0)] } else { vec![] }, style)
            });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FAMILY, 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    root.present()
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cdf_ends_at_the_maximum_and_100_percent() {
        let lags: Vec<Duration> = (1..=1000).map(Duration::from_millis).collect();
        let points = cdf(&lags);
        assert!(points.len() <= 502, "{}", points.len());
        assert_eq!(points.last(), Some(&(1000.0, 100.0)));
        assert_eq!(points[0], (1.0, 0.1));
        assert!(cdf(&[]).is_empty());
    }
}
