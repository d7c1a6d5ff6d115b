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

/// Draw `points` (median line + min-max bars) into the SVG file `path`.
pub fn draw(path: &Path, title: &str, x_label: &str, points: &[Point]) -> Result<()> {
    ensure!(
        !points.is_empty(),
        "nothing to plot: no generation test ran"
    );
    ensure!(
        points
            .iter()
            .all(|p| [p.x, p.median, p.min, p.max].iter().all(|v| v.is_finite())),
        "cannot plot non-finite measurements"
    );
    let x_max = points.iter().map(|p| p.x).fold(0.0, f64::max).max(1.0) * 1.05;
    let y_max = points.iter().map(|p| p.max).fold(0.0, f64::max).max(1.0) * 1.15;
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("plot {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-x_max * 0.03..x_max, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
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
        .map_err(|e| err(&e))?
        .label("median")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    chart
        .draw_series(
            sorted
                .iter()
                .map(|p| ErrorBar::new_vertical(p.x, p.min, p.median, p.max, BLUE.filled(), 8)),
        )
        .map_err(|e| err(&e))?;
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_an_svg_with_the_points_and_refuses_nonsense() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tg.svg");
        let pts = [
            Point {
                x: 0.0,
                median: 170.0,
                min: 169.0,
                max: 171.0,
            },
            Point {
                x: 4096.0,
                median: 137.0,
                min: 136.0,
                max: 137.5,
            },
        ];
        draw(&path, "tg128", "context depth (tokens)", &pts).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        assert!(
            svg.contains("tg128") && svg.contains("4000"),
            "title and axis labels"
        );
        assert!(draw(&path, "t", "x", &[]).is_err());
        let nan = [Point {
            x: 0.0,
            median: f64::NAN,
            min: 0.0,
            max: 1.0,
        }];
        assert!(draw(&path, "t", "x", &nan).is_err());
    }
}
