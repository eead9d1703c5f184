//! PNG plots with `plotters` (bitmap backend, PNG encoder, `ab_glyph` text).
//!
//! Text in a bitmap needs a font. plotters' default `ttf` feature asks fontconfig for system
//! fonts at run time; instead the crate uses the `ab_glyph` feature and registers one TTF file by
//! its bytes ([`register_font`]). The default file is DejaVu Sans from Debian's
//! `fonts-dejavu-core` ([`DEFAULT_FONT`], on the project's machine image; `make setup` can
//! `apt-get install fonts-dejavu-core` elsewhere); `--font` / `KVMESH_FONT` point elsewhere.
//! Without a font the report is still written, without plots, and says why.

use super::summary::PolicySummary;
use crate::stats::cdf;
use plotters::prelude::*;
use std::path::Path;

/// Default font file (Debian `fonts-dejavu-core`).
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// Environment variable overriding the font file.
pub const FONT_ENV: &str = "KVMESH_FONT";
/// File name of the TTFT CDF plot.
pub const TTFT_CDF_PNG: &str = "ttft_cdf.png";
/// File name of the hit-rate plot.
pub const HIT_RATE_PNG: &str = "hit_rate.png";
/// File name of the requests-per-worker plot.
pub const REQUESTS_PER_WORKER_PNG: &str = "requests_per_worker.png";

const SIZE: (u32, u32) = (1000, 600);
const FONT: &str = "sans-serif";

/// Why a plot could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The font file could not be read.
    #[error("font {path}: {source} (install Debian's fonts-dejavu-core or pass --font)")]
    FontRead {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a usable font.
    #[error("font {path} is not a valid TrueType/OpenType font")]
    FontInvalid {
        /// The file.
        path: String,
    },
    /// plotters failed.
    #[error("drawing {file}: {reason}")]
    Draw {
        /// The plot file.
        file: String,
        /// plotters' message.
        reason: String,
    },
}

/// Loads and registers the font used for all plot text. Call once per process; the bytes are
/// kept for the life of the process, as plotters requires.
pub fn register_font(path: &Path) -> Result<(), PlotError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path)
        .map_err(|source| PlotError::FontRead { path: shown.clone(), source })?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font(FONT, FontStyle::Normal, bytes)
        .map_err(|_| PlotError::FontInvalid { path: shown })
}

fn draw_err<E: std::fmt::Debug>(file: &Path) -> impl Fn(E) -> PlotError + '_ {
    move |e| PlotError::Draw { file: file.display().to_string(), reason: format!("{e:?}") }
}

/// Draws the legend box at `position` and writes the file: the same closing for every plot.
fn finish<'a, DB, CT, E>(
    chart: &mut ChartContext<'a, DB, CT>,
    root: &DrawingArea<DB, plotters::coord::Shift>,
    position: SeriesLabelPosition,
    err: &E,
) -> Result<(), PlotError>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
    E: Fn(DrawingAreaErrorKind<DB::ErrorType>) -> PlotError,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

fn color(i: usize) -> RGBColor {
    const PALETTE: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    PALETTE[i % PALETTE.len()]
}

/// TTFT CDF per policy, log-scaled time axis.
pub fn ttft_cdf(path: &Path, summaries: &[PolicySummary]) -> Result<(), PlotError> {
    let err = draw_err(path);
    let all: Vec<f64> =
        summaries.iter().flat_map(|s| s.ttft_sorted.iter().copied()).filter(|x| *x > 0.0).collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = all.iter().copied().fold(0.0_f64, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo { (lo * 0.9, hi * 1.1) } else { (0.1, 10_000.0) };
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT CDF per policy", (FONT, 26))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
        .map_err(&err)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("fraction of requests")
        .label_style((FONT, 14))
        .draw()
        .map_err(&err)?;
    for (i, s) in summaries.iter().enumerate() {
        let pts: Vec<(f64, f64)> =
            cdf(&s.ttft_sorted, 400).into_iter().filter(|(x, _)| *x > 0.0).collect();
        let c = color(i);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(&err)?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    finish(&mut chart, &root, SeriesLabelPosition::LowerRight, &err)
}

/// Engine hit rate and router-predicted block-weighted rate per policy, with the ceiling line.
pub fn hit_rate(
    path: &Path,
    summaries: &[PolicySummary],
    ceiling: Option<f64>,
) -> Result<(), PlotError> {
    let err = draw_err(path);
    let n = summaries.len().max(1);
    let top = summaries
        .iter()
        .flat_map(|s| [s.engine_hit_rate, s.router_block_rate.map(|r| r.value)])
        .flatten()
        .chain(ceiling)
        .fold(0.1_f64, f64::max)
        .min(1.0)
        * 1.4; // headroom for the legend
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let names: Vec<String> = summaries.iter().map(|s| s.name.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption("Prefix-cache hit rate vs intrinsic ceiling", (FONT, 26))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)
        .map_err(&err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 {
                names.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{:.0}%", y * 100.0))
        .y_desc("hit rate (block-weighted)")
        .label_style((FONT, 14))
        .draw()
        .map_err(&err)?;
    let engine = color(0);
    let router = color(1);
    chart
        .draw_series(summaries.iter().enumerate().filter_map(|(i, s)| {
            s.engine_hit_rate.map(|h| {
                Rectangle::new([(i as f64 + 0.12, 0.0), (i as f64 + 0.48, h)], engine.filled())
            })
        }))
        .map_err(&err)?
        .label("engine (counters)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], engine.filled()));
    chart
        .draw_series(summaries.iter().enumerate().filter_map(|(i, s)| {
            s.router_block_rate.map(|r| {
                Rectangle::new(
                    [(i as f64 + 0.52, 0.0), (i as f64 + 0.88, r.value)],
                    router.filled(),
                )
            })
        }))
        .map_err(&err)?
        .label("router predicted")
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], router.filled()));
    if let Some(c) = ceiling {
        chart
            .draw_series(LineSeries::new(vec![(0.0, c), (n as f64, c)], BLACK.stroke_width(2)))
            .map_err(&err)?
            .label(format!("intrinsic ceiling {:.1}%", c * 100.0))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    }
    finish(&mut chart, &root, SeriesLabelPosition::UpperRight, &err)
}

/// Requests per worker, bars grouped by worker, one colour per policy.
pub fn requests_per_worker(path: &Path, summaries: &[PolicySummary]) -> Result<(), PlotError> {
    let err = draw_err(path);
    let mut workers: Vec<String> =
        summaries.iter().flat_map(|s| s.requests_balance.per_worker.keys().cloned()).collect();
    workers.sort();
    workers.dedup();
    let nw = workers.len().max(1);
    let np = summaries.len().max(1);
    let top = summaries
        .iter()
        .flat_map(|s| s.requests_balance.per_worker.values().copied())
        .fold(1.0_f64, f64::max)
        * 1.45; // headroom for the legend
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Requests per worker", (FONT, 26))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..nw as f64, 0.0..top)
        .map_err(&err)?;
    let labels = workers.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(nw * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .y_desc("successful requests")
        .label_style((FONT, 14))
        .draw()
        .map_err(&err)?;
    let width = 0.8 / np as f64;
    for (p, s) in summaries.iter().enumerate() {
        let c = color(p);
        let bars = workers.iter().enumerate().map(|(w, name)| {
            let v = s.requests_balance.per_worker.get(name).copied().unwrap_or(0.0);
            let x0 = w as f64 + 0.1 + p as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width * 0.95, v)], c.filled())
        });
        chart
            .draw_series(bars)
            .map_err(&err)?
            .label(s.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], c.filled()));
    }
    finish(&mut chart, &root, SeriesLabelPosition::UpperRight, &err)
}

/// One line of a sweep plot: a policy's `(rate, value)` points; invalid points are drawn hollow.
#[derive(Debug, Clone, PartialEq)]
pub struct RateSeries {
    /// Legend label.
    pub label: String,
    /// `(rate, value, valid)`, any order.
    pub points: Vec<(f64, f64, bool)>,
}

/// A value against the offered rate, one line per policy (the sweep's TTFT p90 and hit-rate
/// plots). `log_y` for latencies; `reference` draws a horizontal dashed line (the ceiling).
pub fn vs_rate(
    path: &Path,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[RateSeries],
    log_y: bool,
    reference: Option<(f64, &str)>,
) -> Result<(), PlotError> {
    let err = draw_err(path);
    let xs: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(reference.map(|r| r.0))
        .filter(|y| y.is_finite())
        .collect();
    let x_hi = xs.iter().copied().fold(0.0_f64, f64::max).max(1e-3) * 1.05;
    let y_hi = ys.iter().copied().fold(0.0_f64, f64::max).max(1e-3) * 1.1;
    let y_lo = ys.iter().copied().filter(|y| *y > 0.0).fold(f64::INFINITY, f64::min);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&err)?;
    let mut builder = ChartBuilder::on(&root);
    builder.caption(caption, (FONT, 24)).margin(15).x_label_area_size(45).y_label_area_size(65);
    let sorted_pts = |s: &RateSeries| {
        let mut p = s.points.clone();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        p
    };
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x_desc)
                .y_desc(y_desc)
                .label_style((FONT, 14))
                .draw()
                .map_err(&err)?;
            if let Some((y, label)) = reference {
                let dash = BLACK.mix(0.6);
                chart
                    .draw_series(DashedLineSeries::new(
                        vec![(0.0, y), (x_hi, y)],
                        8,
                        6,
                        dash.stroke_width(1),
                    ))
                    .map_err(&err)?
                    .label(label.to_string())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], dash));
            }
            for (i, s) in series.iter().enumerate() {
                let c = color(i);
                let pts = sorted_pts(s);
                chart
                    .draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), c.stroke_width(2)))
                    .map_err(&err)?
                    .label(s.label.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                chart
                    .draw_series(pts.iter().map(|p| {
                        Circle::new((p.0, p.1), 4, if p.2 { c.filled() } else { c.stroke_width(1) })
                    }))
                    .map_err(&err)?;
            }
            finish(&mut chart, &root, SeriesLabelPosition::UpperLeft, &err)
        }};
    }
    if log_y && y_lo.is_finite() && y_hi > y_lo {
        body!(builder
            .build_cartesian_2d(0.0..x_hi, (y_lo * 0.8..y_hi * 1.2).log_scale())
            .map_err(&err)?)
    } else {
        body!(builder.build_cartesian_2d(0.0..x_hi, 0.0..y_hi).map_err(&err)?)
    }
}
