//! Routing heat: how often each (layer, expert) was routed to, counted by the forward pass,
//! persisted as `routing-heat.json` where [`HeatHome`] says (the server: beside its KV slot files),
//! and used at start to choose the experts of the pinned part of the cache.
//!
//! The file is small (one count per expert) and written crash-safely: a temporary file, fsync,
//! then rename over the old one, so a reader sees the old counts or the new, never half a file.
//! A file that does not match the model's shape is ignored (counting starts again).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::{io_err, Result};

pub const HEAT_FILE: &str = "routing-heat.json";
const HEAT_FORMAT: &str = "colibri-routing-heat";

/// Where the routing heat file is read from at load and saved to.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum HeatHome {
    /// The model directory: read there and saved there (the Rust API's default; examples and
    /// benchmarks keep their heat between runs this way).
    #[default]
    ModelDir,
    /// A state directory of its own (the server's KV directory): read from there, else (the
    /// first time) from the model directory, where versions before it saved the heat; saved
    /// there only, so the model directory is never written.
    Dir(PathBuf),
    /// Counted in memory only: read from the model directory when a file is there, never saved.
    Memory,
}

impl HeatHome {
    /// The file to read at load for the model in `model_dir`, and the one to save to (`None`:
    /// never saved).
    pub fn paths(&self, model_dir: &Path) -> (PathBuf, Option<PathBuf>) {
        let in_model = model_dir.join(HEAT_FILE);
        match self {
            HeatHome::ModelDir => (in_model.clone(), Some(in_model)),
            HeatHome::Dir(d) => {
                let own = d.join(HEAT_FILE);
                let read = if own.exists() { own.clone() } else { in_model };
                (read, Some(own))
            }
            HeatHome::Memory => (in_model, None),
        }
    }

    /// Makes a state directory home if it is missing (at load; the model directory is never
    /// made). A failure shows later as a failed save, which changes nothing else.
    pub fn make_dir(&self) -> Result<()> {
        match self {
            HeatHome::Dir(d) => fs::create_dir_all(d).map_err(io_err(d)),
            HeatHome::ModelDir | HeatHome::Memory => Ok(()),
        }
    }
}

/// Routing counts of one MoE layer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerHeat {
    /// The model layer index.
    pub layer: usize,
    /// `counts[e]`: tokens routed to expert `e` of this layer.
    pub counts: Vec<u64>,
}

/// Routing counts of every MoE layer (what `routing-heat.json` holds).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoutingHeat {
    pub format: String,
    pub version: u32,
    pub experts: usize,
    pub layers: Vec<LayerHeat>,
}

/// The live counters (one atomic per expert record, in record order of the MoE layers).
pub(crate) struct Heat {
    layer_ids: Vec<usize>,
    experts: usize,
    counts: Vec<AtomicU64>,
}

impl Heat {
    pub fn new(layer_ids: Vec<usize>, experts: usize) -> Heat {
        let n = layer_ids.len() * experts;
        Heat {
            layer_ids,
            experts,
            counts: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Starts from a saved file if it matches this model's shape.
    pub fn load(&self, path: &Path) {
        let Ok(text) = fs::read_to_string(path) else {
            return;
        };
        let Ok(h) = serde_json::from_str::<RoutingHeat>(&text) else {
            return;
        };
        let fits = h.format == HEAT_FORMAT
            && h.experts == self.experts
            && h.layers.len() == self.layer_ids.len()
            && h.layers
                .iter()
                .zip(&self.layer_ids)
                .all(|(l, &id)| l.layer == id && l.counts.len() == self.experts);
        if fits {
            for (m, l) in h.layers.iter().enumerate() {
                for (e, &c) in l.counts.iter().enumerate() {
                    self.counts[m * self.experts + e].store(c, Ordering::Relaxed);
                }
            }
        }
    }

    /// The model layer index of each MoE layer, ascending (the counts' order).
    pub fn layer_ids(&self) -> &[usize] {
        &self.layer_ids
    }

    /// Counts one routing of expert `e` in MoE layer ordinal `m`.
    pub fn add(&self, m: usize, e: usize) {
        self.counts[m * self.experts + e].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> RoutingHeat {
        RoutingHeat {
            format: HEAT_FORMAT.into(),
            version: 1,
            experts: self.experts,
            layers: self
                .layer_ids
                .iter()
                .enumerate()
                .map(|(m, &layer)| LayerHeat {
                    layer,
                    counts: (0..self.experts)
                        .map(|e| self.counts[m * self.experts + e].load(Ordering::Relaxed))
                        .collect(),
                })
                .collect(),
        }
    }

    /// Record indices (MoE ordinal * experts + expert) by count, hottest first; never-routed
    /// experts are left out. Ties: lower record first.
    pub fn hottest(&self) -> Vec<u32> {
        let mut v: Vec<(u64, u32)> = self
            .counts
            .iter()
            .enumerate()
            .map(|(i, c)| (c.load(Ordering::Relaxed), i as u32))
            .filter(|&(c, _)| c > 0)
            .collect();
        v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        v.into_iter().map(|(_, i)| i).collect()
    }

    /// Writes the counts to `path` crash-safely (temp file, fsync, rename). Its directory must
    /// exist: a model directory removed while the model runs is not made again by a save (the
    /// save fails instead; [`HeatHome::make_dir`] makes a state directory once, at load).
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string(&self.snapshot()).expect("plain data serializes");
        let tmp = path.with_extension("json.tmp");
        {
            let mut f = fs::File::create(&tmp).map_err(io_err(&tmp))?;
            f.write_all(text.as_bytes()).map_err(io_err(&tmp))?;
            f.sync_all().map_err(io_err(&tmp))?;
        }
        fs::rename(&tmp, path).map_err(io_err(path))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_and_mismatched_files_are_ignored() {
        let d = std::env::temp_dir().join(format!("colibri-heat-{}", std::process::id()));
        fs::create_dir_all(&d).unwrap();
        let p = d.join(HEAT_FILE);
        let h = Heat::new(vec![1, 2], 4);
        h.add(0, 3);
        h.add(0, 3);
        h.add(1, 0);
        h.save(&p).unwrap();
        assert!(!d.join("routing-heat.json.tmp").exists());
        let g = Heat::new(vec![1, 2], 4);
        g.load(&p);
        assert_eq!(g.snapshot(), h.snapshot());
        assert_eq!(g.hottest(), vec![3, 4]);
        // Another shape: ignored.
        let other = Heat::new(vec![0, 1, 2], 4);
        other.load(&p);
        assert!(other.hottest().is_empty());
        // A torn or foreign file: ignored.
        fs::write(&p, "{\"format\": \"colibri-routing-heat\", \"layers\": [").unwrap();
        let t = Heat::new(vec![1, 2], 4);
        t.load(&p);
        assert!(t.hottest().is_empty());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_heat_lives_where_its_home_says_and_an_old_one_is_taken_from_the_model_dir() {
        let root = std::env::temp_dir().join(format!("colibri-heat-home-{}", std::process::id()));
        let (model, state) = (root.join("model"), root.join("kv"));
        fs::create_dir_all(&model).unwrap();
        let in_model = model.join(HEAT_FILE);
        // The model directory's own: read and saved there.
        assert_eq!(
            HeatHome::ModelDir.paths(&model),
            (in_model.clone(), Some(in_model.clone()))
        );
        // Memory: read from the model directory, never saved.
        assert_eq!(HeatHome::Memory.paths(&model), (in_model.clone(), None));
        // A state directory: no file there yet, so the model directory's (an older version's)
        // is read once; saves go to the state directory (made at load if missing) only.
        let home = HeatHome::Dir(state.clone());
        home.make_dir().unwrap();
        assert!(state.is_dir());
        let own = state.join(HEAT_FILE);
        let old = Heat::new(vec![1], 4);
        old.add(0, 2);
        old.save(&in_model).unwrap();
        let (read, save) = home.paths(&model);
        assert_eq!(
            (read.clone(), save.clone()),
            (in_model.clone(), Some(own.clone()))
        );
        let h = Heat::new(vec![1], 4);
        h.load(&read);
        assert_eq!(h.snapshot(), old.snapshot());
        h.add(0, 1);
        h.save(save.as_ref().unwrap()).unwrap();
        assert!(own.is_file());
        // The model directory's file is left as it was; from now on the state's is the one read.
        let untouched = Heat::new(vec![1], 4);
        untouched.load(&in_model);
        assert_eq!(untouched.snapshot(), old.snapshot());
        assert_eq!(home.paths(&model).0, own);
        let again = Heat::new(vec![1], 4);
        again.load(&home.paths(&model).0);
        assert_eq!(again.snapshot(), h.snapshot());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_save_into_a_removed_model_directory_fails_and_does_not_make_it_again() {
        let model = std::env::temp_dir().join(format!("colibri-heat-gone-{}", std::process::id()));
        fs::create_dir_all(&model).unwrap();
        let (_, save) = HeatHome::ModelDir.paths(&model);
        HeatHome::ModelDir.make_dir().unwrap();
        fs::remove_dir_all(&model).unwrap();
        let h = Heat::new(vec![1], 4);
        h.add(0, 1);
        let err = h.save(save.as_ref().unwrap()).unwrap_err().to_string();
        assert!(err.contains("routing-heat.json"), "{err}");
        assert!(!model.exists());
    }
}
