//! The soak plot: four panels (agent RSS, agent fds, sessions in the maps, errors) over time,
//! as a PNG, with `plotters`' bitmap backend. Text is drawn with `ab_glyph` from DejaVu Sans
//! (`/usr/share/fonts/truetype/dejavu`, Debian's `fonts-dejavu-core`): the `ttf` feature would
//! need fontconfig and freetype development files at build time.

use std::path::Path;

use plotters::prelude::*;

use crate::soak::Sample;

/// One panel: title, the sampled value, line colour.
type Panel = (&'static str, fn(&Sample) -> f64, RGBColor);

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Draws `series` into `out` (PNG, 1200×800). Errors: no font, or the backend's.
pub fn soak_png(out: &Path, series: &[Sample]) -> anyhow::Result<()> {
    let bytes = std::fs::read(FONT).map_err(|e| anyhow::anyhow!("font {FONT}: {e}"))?;
    // register_font keeps the bytes for the life of the process.
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("font {FONT}: not an OpenType font"))?;
    let root = BitMapBackend::new(out, (1200, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let t_max = series.iter().map(|s| s.t_s).fold(1.0, f64::max);
    let panels: [Panel; 4] = [
        ("agent RSS (MiB)", |s| s.rss_mib, BLUE),
        ("agent open fds", |s| s.fds, RED),
        ("sessions in the maps", |s| s.sessions, GREEN),
        ("errors (cumulative)", |s| s.errors, BLACK),
    ];
    for (area, (title, f, color)) in root.split_evenly((2, 2)).iter().zip(panels) {
        let y_max = series.iter().map(f).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
        chart.configure_mesh().x_desc("seconds").label_style(("sans-serif", 14)).draw()?;
        chart.draw_series(LineSeries::new(series.iter().map(|s| (s.t_s, f(s))), color.stroke_width(2)))?;
    }
    root.present()?;
    Ok(())
}
