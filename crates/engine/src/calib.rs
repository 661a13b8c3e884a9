//! Importance statistics for weighted int4 quantization (`colibri convert --calibration`), in
//! the manner of AWQ and llama.cpp's imatrix: the f32 model runs over a calibration text and
//! every weight matrix's product records, per input column, the mean square of the activations
//! it multiplied; the quantizer then weighs each column's squared error by that mean
//! (`quant::quantize_q4_weighted`), so the error lands where the inputs are small.
//!
//! Routed experts get the statistics of the tokens routed to them. An expert no calibration
//! token reached takes, for gate and up, the statistics of every token entering its layer's
//! experts (the same input space) and, for down (its own hidden space), none: the plain error.
//! Matrices used in row blocks with different inputs (MLA's per-head products, DeepSeek-V4's
//! grouped output projection) keep one set of statistics per block. The embedding has no input
//! product and is quantized as without calibration, unless it is tied to the LM head (one
//! matrix): then it takes the LM head's statistics.
//!
//! Recording costs one relaxed atomic load per product when off; it is for conversion only.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::format::{DType, Manifest};

/// Sums of squares per input column and how many rows (tokens) they cover.
#[derive(Clone, Debug, Default)]
struct Sums {
    sq: Vec<f64>,
    n: u64,
}

impl Sums {
    /// Adds `x`'s `n` rows of `cols` values.
    fn add(&mut self, x: &[f32], cols: usize) {
        if self.sq.is_empty() {
            self.sq = vec![0.0; cols];
        }
        for row in x.chunks_exact(cols) {
            for (s, &v) in self.sq.iter_mut().zip(row) {
                *s += (v as f64) * (v as f64);
            }
            self.n += 1;
        }
    }

    /// The mean square per column (`None` without rows).
    fn mean(&self) -> Option<Vec<f32>> {
        (self.n > 0).then(|| {
            self.sq
                .iter()
                .map(|&s| (s / self.n as f64) as f32)
                .collect()
        })
    }
}

/// What a recording model gathers: resident products by where their weights are, routed
/// experts by record.
#[derive(Default)]
struct Stats {
    /// `(byte offset in resident.bin, rows)` of the product's weight -> its inputs.
    resident: HashMap<(usize, usize), Sums>,
    /// `(expert record, part: 0 gate, 1 up, 2 down)` -> its inputs.
    experts: HashMap<(usize, usize), Sums>,
    /// A MoE layer's first record -> the inputs of every token entering its routed experts.
    layer_inputs: HashMap<usize, Sums>,
}

/// The recording switch and what was recorded (a field of every `Model`; off unless
/// `Model::collect_importance` runs).
#[derive(Default)]
pub(crate) struct Recorder {
    on: AtomicBool,
    stats: Mutex<Stats>,
}

impl Recorder {
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Starts a recording from nothing.
    pub(crate) fn start(&self) {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = Stats::default();
        self.on.store(true, Ordering::Relaxed);
    }

    pub(crate) fn stop(&self) {
        self.on.store(false, Ordering::Relaxed);
    }

    /// `x` (rows of `cols`) went into the resident weight at byte `offset` with `rows` rows.
    pub(crate) fn resident(&self, offset: usize, rows: usize, x: &[f32], cols: usize) {
        if self.is_on() && cols > 0 {
            let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.resident.entry((offset, rows)).or_default().add(x, cols);
        }
    }

    /// `x` went into part `part` (0 gate, 1 up, 2 down) of expert record `record`.
    pub(crate) fn expert(&self, record: usize, part: usize, x: &[f32], cols: usize) {
        if self.is_on() && cols > 0 {
            let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.experts.entry((record, part)).or_default().add(x, cols);
        }
    }

    /// `x` entered the routed experts of the MoE layer whose records start at `first_record`.
    pub(crate) fn layer_input(&self, first_record: usize, x: &[f32], cols: usize) {
        if self.is_on() && cols > 0 {
            let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            s.layer_inputs.entry(first_record).or_default().add(x, cols);
        }
    }

    /// The recording as importance weights by tensor name, placed by `manifest` (an f32
    /// model's: every recorded weight is an f32 matrix there); `tokens`: the calibration
    /// tokens run.
    pub(crate) fn importance(&self, manifest: &Manifest, tokens: usize) -> Importance {
        let s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let mut resident: BTreeMap<String, Vec<Segment>> = BTreeMap::new();
        for (name, t) in &manifest.resident.tensors {
            if t.dtype != DType::F32 || t.shape.len() != 2 || t.shape[0] == 0 {
                continue;
            }
            let row_bytes = t.nbytes / t.shape[0];
            let mut segs: Vec<Segment> = s
                .resident
                .iter()
                .filter(|((off, _), _)| (t.offset..t.offset + t.nbytes).contains(off))
                .filter_map(|(&(off, rows), sums)| {
                    Some(Segment {
                        first_row: (off - t.offset) / row_bytes,
                        rows,
                        weights: sums.mean()?,
                    })
                })
                .filter(|seg| seg.weights.len() == t.shape[1])
                .collect();
            if !segs.is_empty() {
                segs.sort_by_key(|seg| (seg.first_row, seg.rows));
                resident.insert(name.clone(), segs);
            }
        }
        let mut experts = BTreeMap::new();
        if let Some(x) = &manifest.experts {
            for l in &x.layers {
                let pooled = s.layer_inputs.get(&l.first_record).and_then(Sums::mean);
                for e in 0..l.count {
                    let own = |part: usize| {
                        s.experts
                            .get(&(l.first_record + e, part))
                            .and_then(Sums::mean)
                    };
                    let parts = [
                        own(0).or_else(|| pooled.clone()),
                        own(1).or_else(|| pooled.clone()),
                        own(2),
                    ];
                    if parts.iter().any(Option::is_some) {
                        experts.insert((l.layer, e), parts);
                    }
                }
            }
        }
        Importance {
            resident,
            experts,
            tokens,
        }
    }
}

/// Rows `first_row .. first_row + rows` of a matrix, weighted per column by `weights`.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub first_row: usize,
    pub rows: usize,
    pub weights: Vec<f32>,
}

/// Per-column importance weights (mean squared input activations) of a model's weight matrices,
/// from [`crate::model::Model::collect_importance`]; what `convert::convert_with` quantizes by.
#[derive(Clone, Debug, Default)]
pub struct Importance {
    /// Resident matrices by colibri name (`layers.3.q`, `lm_head`): their row segments.
    pub resident: BTreeMap<String, Vec<Segment>>,
    /// Routed experts by `(model layer, expert)`: gate, up and down weights (`None`: none).
    pub experts: BTreeMap<(usize, usize), [Option<Vec<f32>>; 3]>,
    /// Calibration tokens the statistics come from.
    pub tokens: usize,
}

impl Importance {
    /// Row `r`'s weights in the resident matrix `name` (the first segment holding it).
    pub fn resident_row(&self, name: &str, r: usize) -> Option<&[f32]> {
        self.resident
            .get(name)?
            .iter()
            .find(|s| (s.first_row..s.first_row + s.rows).contains(&r))
            .map(|s| s.weights.as_slice())
    }

    /// The weights of part `part` (0 gate, 1 up, 2 down) of routed expert `expert` of `layer`.
    pub fn expert(&self, layer: usize, expert: usize, part: usize) -> Option<&[f32]> {
        self.experts.get(&(layer, expert))?[part].as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_average_squares_per_column() {
        let mut s = Sums::default();
        assert_eq!(s.mean(), None);
        s.add(&[1.0, -2.0, 3.0, 0.0], 2);
        s.add(&[-3.0, 2.0], 2);
        assert_eq!(s.n, 3);
        assert_eq!(s.mean(), Some(vec![19.0 / 3.0, 8.0 / 3.0]));
    }

    #[test]
    fn a_row_takes_the_first_segment_holding_it() {
        let seg = |first_row, rows, w: f32| Segment {
            first_row,
            rows,
            weights: vec![w; 2],
        };
        let mut imp = Importance::default();
        imp.resident
            .insert("o".into(), vec![seg(0, 2, 1.0), seg(2, 3, 2.0)]);
        assert_eq!(imp.resident_row("o", 1), Some(&[1.0, 1.0][..]));
        assert_eq!(imp.resident_row("o", 4), Some(&[2.0, 2.0][..]));
        assert_eq!(imp.resident_row("o", 5), None);
        assert_eq!(imp.resident_row("q", 0), None);
        imp.experts.insert((1, 3), [Some(vec![1.0]), None, None]);
        assert_eq!(imp.expert(1, 3, 0), Some(&[1.0][..]));
        assert_eq!(imp.expert(1, 3, 2), None);
        assert_eq!(imp.expert(0, 3, 0), None);
    }

    #[test]
    fn recording_happens_only_while_on() {
        let r = Recorder::default();
        r.resident(0, 1, &[1.0], 1);
        assert!(r.stats.lock().unwrap().resident.is_empty());
        r.start();
        r.resident(0, 1, &[2.0], 1);
        r.stop();
        r.resident(0, 1, &[5.0], 1);
        let s = r.stats.lock().unwrap();
        assert_eq!(s.resident[&(0, 1)].mean(), Some(vec![4.0]));
    }
}
