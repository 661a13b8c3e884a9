//! Helpers shared by the measuring examples (a directory without `main.rs`, so Cargo does not
//! build it as an example of its own).

/// The middle value of `v` (the upper middle for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
