//! SVG charts for `nibble bench --plot` (plotters, SVG backend only): one series of medians
//! with min-max bars against a numeric x axis (context depth).

use anyhow::{ensure, Context as _, Result};
use plotters::prelude::*;
use std::path::Path;

/// One measurement: x and the tok/s statistics at it.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    pub x: f64,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// Draw one panel per `(x label, points)` side by side (median line + min-max bars each) into
/// the SVG file `path`.
pub fn draw(path: &Path, title: &str, panels: &[(&str, Vec<Point>)]) -> Result<()> {
    ensure!(
        panels.iter().any(|(_, p)| !p.is_empty()),
        "nothing to plot: no generation test ran"
    );
    ensure!(
        panels
            .iter()
            .flat_map(|(_, p)| p)
            .all(|p| [p.x, p.median, p.min, p.max].iter().all(|v| v.is_finite())),
        "cannot plot non-finite measurements"
    );
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("plot {}: {e}", path.display());
    let root = SVGBackend::new(path, (640 * panels.len() as u32, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    for ((x_label, points), area) in panels.iter().zip(root.split_evenly((1, panels.len()))) {
        if points.is_empty() {
            continue;
        }
        let x_max = points.iter().map(|p| p.x).fold(0.0, f64::max).max(1.0) * 1.05;
        let y_max = points.iter().map(|p| p.max).fold(0.0, f64::max).max(1.0) * 1.15;
        let mut chart = ChartBuilder::on(&area)
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(-x_max * 0.03..x_max, 0.0..y_max)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(*x_label)
            .y_desc("tokens/s")
            .draw()
            .map_err(|e| err(&e))?;
        let mut sorted = points.to_vec();
        sorted.sort_by(|a, b| a.x.total_cmp(&b.x));
        chart
            .draw_series(LineSeries::new(
                sorted.iter().map(|p| (p.x, p.median)),
                &BLUE,
            ))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(
                sorted
                    .iter()
                    .map(|p| ErrorBar::new_vertical(p.x, p.min, p.median, p.max, BLUE.filled(), 8)),
            )
            .map_err(|e| err(&e))?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(x: f64, median: f64) -> Point {
        Point {
            x,
            median,
            min: median - 1.0,
            max: median + 1.0,
        }
    }

    #[test]
    fn draws_an_svg_with_the_panels_and_refuses_nonsense() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tg.svg");
        let panels = [
            (
                "context depth (tokens)",
                vec![pt(0.0, 170.0), pt(4096.0, 137.0)],
            ),
            ("batch", vec![pt(1.0, 160.0), pt(4.0, 250.0)]),
        ];
        draw(&path, "tg128", &panels).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        assert!(
            svg.contains("tg128") && svg.contains("4000"),
            "title and axis labels"
        );
        assert!(svg.contains("batch"), "second panel");
        assert!(draw(&path, "t", &[("x", vec![])]).is_err());
        let nan = vec![Point {
            x: 0.0,
            median: f64::NAN,
            min: 0.0,
            max: 1.0,
        }];
        assert!(draw(&path, "t", &[("x", nan)]).is_err());
    }
}
