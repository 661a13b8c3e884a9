//! The PyO3 module `colibri._engine`: the only place that knows about Python.
//!
//! Long calls (load, forward, each generated token or scoring step, conversion) release the GIL. The typed,
//! documented Python API (`colibri.Engine`) wraps these in `python/colibri/engine.py`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::convert;
use crate::engine::{GenerateOptions, Generation, Step};
use crate::error::Error;
use crate::format::Quant;
use crate::grammar::{Constraint, GrammarEnv, GrammarKind};
use crate::model::Model as RsModel;
use crate::quant::Kernel;
use crate::score::{ScoreStep, Scoring};
use crate::slots::{self, Slot};
use crate::store::heat::HeatHome;
use crate::store::ExpertOptions;

fn to_py(e: Error) -> PyErr {
    match e {
        Error::Input(m) => PyValueError::new_err(m),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

#[pyclass(frozen, module = "colibri._engine")]
struct Model {
    inner: Arc<RsModel>,
    /// The KV slots: each keeps its history between generations (see slots.rs).
    slots: Vec<Arc<Mutex<Slot>>>,
    /// One line per slot file that was refused at load (reported by the Python side).
    notes: Vec<String>,
    /// The model's own context length (`max_position_embeddings`), whatever `context` chose.
    model_context: usize,
    /// The model directory (its tokenizer is the grammars').
    path: PathBuf,
    /// The tokenizer as grammars need it, built on the first grammar (an error is kept).
    grammar_env: OnceLock<std::result::Result<Arc<GrammarEnv>, String>>,
}

#[pymethods]
impl Model {
    #[new]
    /// `ram_gb`, `pin_gb`, `direct_io`, `prefetch`: the expert cache (store/); each defaults to
    /// its environment variable (`COLI_RAM_GB`, `COLI_PIN_GB`, `COLI_DIRECT_IO`,
    /// `COLI_PREFETCH`), and without a budget every expert is resident. `context`: run with a
    /// context of this many tokens, 1 up to the model's own (default: the model's own).
    #[pyo3(signature = (path, threads=None, kernel=None, slots=1, kv_dir=None, ram_gb=None, pin_gb=None, direct_io=None, prefetch=None, context=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        threads: Option<usize>,
        kernel: Option<String>,
        slots: usize,
        kv_dir: Option<PathBuf>,
        ram_gb: Option<f64>,
        pin_gb: Option<f64>,
        direct_io: Option<bool>,
        prefetch: Option<bool>,
        context: Option<i64>,
    ) -> PyResult<Model> {
        let mut opts = ExpertOptions::from_env().map_err(to_py)?;
        let gb = |name: &str, v: f64| -> PyResult<u64> {
            if v.is_finite() && v >= 0.0 {
                Ok((v * 1e9) as u64)
            } else {
                Err(PyValueError::new_err(format!(
                    "{name} must be a number of GB >= 0"
                )))
            }
        };
        if let Some(v) = ram_gb {
            opts.ram_bytes = Some(gb("ram_gb", v)?);
        } else if opts.ram_bytes.is_none() {
            // No budget asked for: every expert resident when they fit beside the resident
            // part (with room to spare for KV and the system), else what does fit. A directory
            // that is not a model is reported by the load itself.
            opts.ram_bytes = crate::store::fit_ram_bytes(&path, FIT_RESERVE_BYTES)
                .ok()
                .flatten();
        }
        if let Some(v) = pin_gb {
            opts.pin_bytes = gb("pin_gb", v)?;
        }
        if let Some(v) = direct_io {
            opts.direct_io = v;
        }
        if let Some(v) = prefetch {
            opts.prefetch = v;
        }
        // The routing heat lives beside the slot files (never written into the model
        // directory, which may be the package's own); without a KV directory it is counted in
        // memory only. An older version's file in the model directory is still read.
        opts.heat = match &kv_dir {
            Some(dir) => HeatHome::Dir(dir.clone()),
            None => HeatHome::Memory,
        };
        if !(1..=MAX_SLOTS).contains(&slots) {
            return Err(PyValueError::new_err(format!(
                "slots must be 1..{MAX_SLOTS}, got {slots}"
            )));
        }
        let kernel = match kernel {
            None => None,
            Some(name) => {
                let k = Kernel::from_name(&name).ok_or_else(|| {
                    PyValueError::new_err(format!("unknown kernel `{name}` (scalar, avx2, avx512)"))
                })?;
                if !k.available() {
                    return Err(PyValueError::new_err(format!(
                        "kernel `{name}` is not available on this CPU"
                    )));
                }
                Some(k)
            }
        };
        if let Some(n) = context {
            // Refused before the weights are read when the manifest says the model's context
            // (a directory that is not a model is reported by the load itself).
            if let Some(limit) = manifest_context(&path) {
                context_positions(n, limit).map_err(to_py)?;
            }
        }
        let mut m = py
            .detach(|| RsModel::load_with(&path, threads, &opts))
            .map_err(to_py)?;
        if let Some(k) = kernel {
            m.set_kernel(k);
        }
        let model_context = m.cfg.max_positions;
        if let Some(n) = context {
            // Before any slot exists: caches, restores and generation all take the new limit.
            let positions = context_positions(n, model_context).map_err(to_py)?;
            m.set_context(positions).map_err(to_py)?;
        }
        let mut notes = Vec::new();
        let slots = py
            .detach(|| -> crate::error::Result<Vec<Slot>> {
                (0..slots)
                    .map(|i| match &kv_dir {
                        None => Ok(Slot::new(&m)),
                        Some(dir) => slots::open_persistent(&m, dir, i, &mut |n| notes.push(n)),
                    })
                    .collect()
            })
            .map_err(to_py)?;
        Ok(Model {
            inner: Arc::new(m),
            slots: slots.into_iter().map(|s| Arc::new(Mutex::new(s))).collect(),
            notes,
            model_context,
            path,
            grammar_env: OnceLock::new(),
        })
    }

    /// Architecture, sizes, quantization and the compute kernel in use.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = &self.inner;
        let c = &m.cfg;
        let d = PyDict::new(py);
        d.set_item("architecture", c.family.hf_name)?;
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("context_length", c.max_positions)?;
        d.set_item("model_context_length", self.model_context)?;
        d.set_item("quantization", m.manifest.quantization.kind.name())?;
        d.set_item("matrix_dtypes", m.manifest.matrix_dtypes())?;
        d.set_item("hidden_size", c.hidden_size)?;
        d.set_item("num_layers", c.num_layers)?;
        d.set_item("num_experts", c.num_experts)?;
        d.set_item("experts_per_token", c.top_k)?;
        d.set_item("kernel", m.kernel().name())?;
        d.set_item(
            "kernel_prefetch",
            crate::quant::prefetch::prefetch_level().name(),
        )?;
        d.set_item(
            "kernel_prefetch_decode",
            crate::quant::prefetch::decode_prefetch_level().name(),
        )?;
        d.set_item(
            "kernel_avx_vnni",
            m.kernel() == Kernel::Avx2 && crate::quant::avx2_uses_avx_vnni(),
        )?;
        d.set_item("threads", m.threads())?;
        d.set_item("prefill_chunk", m.prefill_chunk())?;
        d.set_item("mla_expanded", m.mla_expanded())?;
        d.set_item("resident_bytes", m.resident_bytes())?;
        d.set_item("eos_token_ids", c.eos_token_ids.clone())?;
        d.set_item("bos_token_id", c.bos_token_id)?;
        d.set_item("chat_template", m.manifest.chat_template.clone())?;
        d.set_item("tokenizer", m.manifest.tokenizer.clone())?;
        d.set_item("tokenizer_config", m.manifest.tokenizer_config.clone())?;
        d.set_item("kv_bytes_per_token", m.new_cache().bytes_per_token())?;
        // The fixed-size state per slot (one copy): linear-attention layers', DeepSeek-V4's
        // windows; 0 without.
        d.set_item("state_bytes_per_slot", m.new_cache().state_bytes())?;
        d.set_item("kv_dtype", m.kv_dtype.name())?;
        Ok(d)
    }

    /// Logits of every position of `ids` from an empty context: `len(ids) * vocab` f32, little-endian.
    fn logits<'py>(&self, py: Python<'py>, ids: Vec<u32>) -> PyResult<Bound<'py, PyBytes>> {
        let m = self.inner.clone();
        let out = py
            .detach(move || {
                let mut kv = m.new_cache();
                m.forward(&ids, &mut kv, true)
            })
            .map_err(to_py)?;
        Ok(PyBytes::new(py, bytemuck::cast_slice(&out)))
    }

    /// Importance statistics for `convert_checkpoint(importance=...)`: the model (an f32
    /// conversion) runs each chunk of token ids from an empty context, recording the mean
    /// squared input of every weight matrix's columns (see `calib.rs`).
    fn collect_importance(&self, py: Python<'_>, chunks: Vec<Vec<u32>>) -> PyResult<Importance> {
        let m = self.inner.clone();
        let imp = py
            .detach(move || m.collect_importance(&chunks))
            .map_err(to_py)?;
        Ok(Importance {
            inner: Arc::new(imp),
        })
    }

    /// Compiles a grammar (`kind`: `json_schema`, `lark` or `regex`) against the model's
    /// tokenizer without generating: ValueError with llguidance's message when it is refused.
    fn check_grammar(&self, py: Python<'_>, kind: &str, source: &str) -> PyResult<()> {
        let env = self.grammar_env(py)?;
        let kind = grammar_kind(kind)?;
        py.detach(|| env.compile(kind, source).map(|_| ()))
            .map_err(to_py)
    }

    /// A generation. With `slot`, the prompt is matched against that slot's history and only
    /// the rest is prefilled; without, it runs in a private, empty history. `grammar`:
    /// `(kind, source)` constrains the output (see `check_grammar`) once the generated tokens
    /// end with `grammar_trigger` (empty: from the first token); `grammar_end_ids` (and the
    /// stop tokens) end it where the grammar accepts.
    #[pyo3(signature = (ids, max_tokens, temperature=0.0, top_p=1.0, stop_token_ids=Vec::new(), seed=None, slot=None, grammar=None, grammar_trigger=Vec::new(), grammar_end_ids=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        stop_token_ids: Vec<u32>,
        seed: Option<u64>,
        slot: Option<usize>,
        grammar: Option<(String, String)>,
        grammar_trigger: Vec<u32>,
        grammar_end_ids: Vec<u32>,
    ) -> PyResult<TokenStream> {
        let constraint = match grammar {
            None => None,
            Some((kind, source)) => {
                let env = self.grammar_env(py)?;
                let kind = grammar_kind(&kind)?;
                let mut ends = grammar_end_ids;
                for &t in &stop_token_ids {
                    if !ends.contains(&t) {
                        ends.push(t);
                    }
                }
                let c = py
                    .detach(|| {
                        let m = env.compile(kind, &source)?;
                        Constraint::new(&env, m, grammar_trigger, ends)
                    })
                    .map_err(to_py)?;
                Some(c)
            }
        };
        let opts = GenerateOptions {
            max_tokens,
            temperature,
            top_p,
            stop_token_ids,
            seed,
        };
        let mut gen = Generation::new(ids, opts).map_err(to_py)?;
        if let Some(c) = constraint {
            gen = gen.with_grammar(c);
        }
        let slot = match slot {
            None => Arc::new(Mutex::new(Slot::new(&self.inner))),
            Some(i) => self.slot(i)?.clone(),
        };
        Ok(TokenStream {
            model: self.inner.clone(),
            gen: Arc::new(Mutex::new(gen)),
            slot,
        })
    }

    /// A scoring of `options` (token lists) after `context`, nothing generated. With `slot`,
    /// the context is matched against that slot's history and only the rest is prefilled, and
    /// the slot keeps the context afterwards; without, it runs in a private, empty history.
    #[pyo3(signature = (context, options, slot=None))]
    fn score(
        &self,
        context: Vec<u32>,
        options: Vec<Vec<u32>>,
        slot: Option<usize>,
    ) -> PyResult<ScoreStream> {
        self.score_many(vec![(context, options)], slot)
    }

    /// One scoring of several questions, each `(context, options)`: the start their contexts
    /// share is prefilled once, the rest of every context runs in one batched pass, and the
    /// options of several tokens in rounds (`score::Scoring`). `scores` lists every question's
    /// options in order. With `slot`, the slot keeps the first question's context.
    #[pyo3(signature = (questions, slot=None))]
    fn score_many(
        &self,
        questions: Vec<(Vec<u32>, Vec<Vec<u32>>)>,
        slot: Option<usize>,
    ) -> PyResult<ScoreStream> {
        let scoring = Scoring::many(questions).map_err(to_py)?;
        let slot = match slot {
            None => Arc::new(Mutex::new(Slot::new(&self.inner))),
            Some(i) => self.slot(i)?.clone(),
        };
        Ok(ScoreStream {
            model: self.inner.clone(),
            scoring: Arc::new(Mutex::new(scoring)),
            slot,
        })
    }

    /// One step of every stream in `streams` together (`engine::step_batch`): one forward pass
    /// runs each one's next tokens over its own slot, reading each weight once for all. Returns
    /// each stream's result as its `step()` would (a token id, `(done, total)` or None), or the
    /// exception its step raised (one stream's bad input fails it alone). Streams must be of this
    /// model and in different slots.
    fn step_many<'py>(
        &self,
        py: Python<'py>,
        streams: Vec<Py<TokenStream>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let pairs: Vec<Shared> = streams
            .iter()
            .map(|s| {
                let s = s.get();
                (s.gen.clone(), s.slot.clone())
            })
            .collect();
        for (i, s) in streams.iter().enumerate() {
            if !Arc::ptr_eq(&s.get().model, &self.inner) {
                return Err(PyValueError::new_err("a stream of another model"));
            }
            if pairs[..i]
                .iter()
                .any(|(_, slot)| Arc::ptr_eq(slot, &pairs[i].1))
            {
                return Err(PyValueError::new_err(
                    "two streams of one step share a KV slot",
                ));
            }
        }
        let model = self.inner.clone();
        let results = py.detach(move || -> PyResult<Vec<crate::error::Result<Step>>> {
            let mut gens = Vec::with_capacity(pairs.len());
            let mut slots = Vec::with_capacity(pairs.len());
            for (g, s) in &pairs {
                gens.push(g.lock().map_err(poisoned)?);
                slots.push(s.lock().map_err(poisoned)?);
            }
            let mut work: Vec<(&mut Generation, &mut Slot)> = gens
                .iter_mut()
                .zip(slots.iter_mut())
                .map(|(g, s)| (&mut **g, &mut **s))
                .collect();
            Ok(crate::engine::step_batch(&model, &mut work))
        })?;
        results
            .into_iter()
            .map(|r| match r {
                Ok(step) => step_to_py(py, step),
                Err(e) => Ok(to_py(e).into_value(py).into_bound(py).into_any()),
            })
            .collect()
    }

    /// Number of KV slots.
    fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The last finished turn's profile as JSON (time per phase, bytes read, cache hits,
    /// prefill/decode tok/s).
    fn last_profile_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.inner.last_profile())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// The last 30 turns' profiles, oldest first, as JSON.
    fn profiles_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.inner.profiles())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Expert ids routed to in the last turn, per layer (empty lists for dense layers).
    fn last_routed_experts(&self) -> Vec<Vec<u32>> {
        self.inner.last_routed_experts()
    }

    /// Routing counts per (MoE layer, expert), as JSON (the heat file's shape).
    fn routing_heat_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.inner.routing_heat())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Where each routed expert is now: `(layer, tiers)` per MoE layer, `tiers` one letter per
    /// expert (`r` resident: no expert cache; `p` pinned, `c` cached, `d` on disk).
    fn expert_tiers(&self) -> Vec<(usize, String)> {
        self.inner
            .expert_tiers()
            .into_iter()
            .map(|(layer, t)| (layer, t.into_iter().map(|t| t.letter()).collect()))
            .collect()
    }

    /// The expert cache's counters as JSON (`null` when every expert is resident).
    fn store_stats_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.inner.store_stats())
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Lines about slot files refused at load (another model, version, layout or damage).
    fn load_notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    /// What a slot holds: `cached_tokens` (history length), `tokens` (the history itself),
    /// `persistent`, and `store_error` when persisting failed.
    fn slot_info<'py>(&self, py: Python<'py>, slot: usize) -> PyResult<Bound<'py, PyDict>> {
        let s = self.slot(slot)?;
        let guard = s
            .lock()
            .map_err(|_| PyRuntimeError::new_err("slot state poisoned"))?;
        let d = PyDict::new(py);
        d.set_item("cached_tokens", guard.tokens.len())?;
        d.set_item("tokens", guard.tokens.clone())?;
        d.set_item("persistent", guard.persistent())?;
        d.set_item("store_error", guard.store_error.clone())?;
        Ok(d)
    }
}

const MAX_SLOTS: usize = 16;
/// Memory left free when sizing the default expert budget: KV, activations, the rest.
const FIT_RESERVE_BYTES: u64 = 1 << 30;

/// The context length a model directory's manifest gives, read without loading the model
/// (None when the manifest or its config cannot be read).
fn manifest_context(dir: &std::path::Path) -> Option<usize> {
    let manifest = crate::format::read_manifest(dir).ok()?;
    let cfg = crate::config::ModelConfig::from_hf(&manifest.config).ok()?;
    Some(cfg.max_positions)
}

/// `n` (as Python gave it) as a context for a model whose context is `limit`.
fn context_positions(n: i64, limit: usize) -> crate::error::Result<usize> {
    let positions = usize::try_from(n).map_err(|_| crate::model::context_error(n, limit))?;
    RsModel::check_context(positions, limit)?;
    Ok(positions)
}

fn grammar_kind(name: &str) -> PyResult<GrammarKind> {
    GrammarKind::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown grammar kind `{name}` (json_schema, lark, regex)"
        ))
    })
}

impl Model {
    /// The model's grammar tokenizer, built once (from the model directory's tokenizer.json).
    fn grammar_env(&self, py: Python<'_>) -> PyResult<Arc<GrammarEnv>> {
        let built = self.grammar_env.get_or_init(|| {
            let m = &self.inner;
            let file = self.path.join(&m.manifest.tokenizer);
            let eos = m.cfg.eos_token_ids.first().copied().unwrap_or(0);
            py.detach(|| GrammarEnv::from_tokenizer_file(&file, m.cfg.vocab_size, eos))
                .map(Arc::new)
                .map_err(|e| e.to_string())
        });
        built.clone().map_err(PyRuntimeError::new_err)
    }

    fn slot(&self, i: usize) -> PyResult<&Arc<Mutex<Slot>>> {
        self.slots.get(i).ok_or_else(|| {
            PyValueError::new_err(format!("slot must be 0..{}, got {i}", self.slots.len() - 1))
        })
    }
}

/// Tokens of one generation, computed one per `__next__` with the GIL released.
#[pyclass(frozen, module = "colibri._engine")]
struct TokenStream {
    model: Arc<RsModel>,
    gen: Arc<Mutex<Generation>>,
    slot: Arc<Mutex<Slot>>,
}

/// A generation and its slot, as a stream holds them.
type Shared = (Arc<Mutex<Generation>>, Arc<Mutex<Slot>>);

/// A step as Python sees it: a token id, `(done, total)` after a prefill part, or None.
fn step_to_py(py: Python<'_>, step: Step) -> PyResult<Bound<'_, PyAny>> {
    Ok(match step {
        Step::Token(t) => t.into_pyobject(py)?.into_any(),
        Step::Prefilled { done, total } => (done, total).into_pyobject(py)?.into_any(),
        Step::End => py.None().into_bound(py),
    })
}

fn poisoned<T>(_: T) -> PyErr {
    PyRuntimeError::new_err("generation state poisoned")
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        let model = self.model.clone();
        let gen = self.gen.clone();
        let slot = self.slot.clone();
        py.detach(move || {
            let mut gen = gen.lock().map_err(poisoned)?;
            let mut slot = slot.lock().map_err(poisoned)?;
            gen.next_token(&model, &mut slot).map_err(to_py)
        })
    }

    /// One step: a token id; `(done, total)` prompt tokens after a part of the prefill; or
    /// `None` once the generation has ended.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let model = self.model.clone();
        let gen = self.gen.clone();
        let slot = self.slot.clone();
        let step = py.detach(move || {
            let mut gen = gen.lock().map_err(poisoned)?;
            let mut slot = slot.lock().map_err(poisoned)?;
            gen.step(&model, &mut slot).map_err(to_py)
        })?;
        Ok(Some(step_to_py(py, step)?).filter(|o| !o.is_none()))
    }

    /// Prompt tokens whose KV came from the slot's history (None before the first token).
    #[getter]
    fn reused_tokens(&self) -> PyResult<Option<usize>> {
        Ok(self.gen.lock().map_err(poisoned)?.reused())
    }

    /// The grammar's state: None without one, else `pending` (before its trigger), `active`,
    /// `satisfied` (completed) or `incomplete` (the generation ended before it was complete).
    #[getter]
    fn grammar_state(&self) -> PyResult<Option<&'static str>> {
        Ok(self
            .gen
            .lock()
            .map_err(poisoned)?
            .grammar_state()
            .map(|s| s.name()))
    }

    /// The grammar's timings: `masks`, `compute_s` (inside mask computation), `wait_s` (steps
    /// waiting for a mask after their forward pass) and `consume_s` (advancing over the sampled
    /// tokens); None without a grammar.
    fn mask_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(st) = self.gen.lock().map_err(poisoned)?.mask_stats() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("masks", st.masks)?;
        d.set_item("compute_s", st.compute.as_secs_f64())?;
        d.set_item("wait_s", st.wait.as_secs_f64())?;
        d.set_item("consume_s", st.consume.as_secs_f64())?;
        Ok(Some(d))
    }

    /// Ends the generation: the slot's history is made durable (fsync when persistent).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let model = self.model.clone();
        let gen = self.gen.clone();
        let slot = self.slot.clone();
        py.detach(move || {
            let mut gen = gen.lock().map_err(poisoned)?;
            let mut slot = slot.lock().map_err(poisoned)?;
            gen.end(&model, &mut slot);
            Ok(())
        })
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        // A stream dropped without close() still ends its turn.
        if let (Ok(mut gen), Ok(mut slot)) = (self.gen.lock(), self.slot.lock()) {
            gen.end(&self.model, &mut slot);
        }
    }
}

/// One scoring, computed a step per `step()` with the GIL released.
#[pyclass(frozen, module = "colibri._engine")]
struct ScoreStream {
    model: Arc<RsModel>,
    scoring: Arc<Mutex<Scoring>>,
    slot: Arc<Mutex<Slot>>,
}

#[pymethods]
impl ScoreStream {
    /// One step: `(done, total)` context tokens after a part of its prefill; the index of the
    /// option just scored; or `None` once every option is scored.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let model = self.model.clone();
        let scoring = self.scoring.clone();
        let slot = self.slot.clone();
        let step = py.detach(move || {
            let mut scoring = scoring.lock().map_err(poisoned)?;
            let mut slot = slot.lock().map_err(poisoned)?;
            scoring.step(&model, &mut slot).map_err(to_py)
        })?;
        Ok(match step {
            ScoreStep::Prefilled { done, total } => {
                Some((done, total).into_pyobject(py)?.into_any())
            }
            ScoreStep::Scored { index } => Some(index.into_pyobject(py)?.into_any()),
            ScoreStep::End => None,
        })
    }

    /// `(logprob, tokens)` of each option scored so far, in order.
    #[getter]
    fn scores(&self) -> PyResult<Vec<(f64, usize)>> {
        let scoring = self.scoring.lock().map_err(poisoned)?;
        Ok(scoring
            .scores()
            .iter()
            .map(|s| (s.logprob, s.tokens))
            .collect())
    }

    /// Context tokens whose KV came from the slot's history (None before the first step).
    #[getter]
    fn reused_tokens(&self) -> PyResult<Option<usize>> {
        Ok(self.scoring.lock().map_err(poisoned)?.reused())
    }

    /// Context tokens the scoring runs in all: the start its questions share once, then each
    /// question's rest.
    #[getter]
    fn context_tokens(&self) -> PyResult<usize> {
        Ok(self.scoring.lock().map_err(poisoned)?.context_tokens())
    }

    /// Ends the scoring: the slot's history (the context) is made durable.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let model = self.model.clone();
        let scoring = self.scoring.clone();
        let slot = self.slot.clone();
        py.detach(move || {
            let mut scoring = scoring.lock().map_err(poisoned)?;
            let mut slot = slot.lock().map_err(poisoned)?;
            scoring.end(&model, &mut slot);
            Ok(())
        })
    }
}

impl Drop for ScoreStream {
    fn drop(&mut self) {
        if let (Ok(mut scoring), Ok(mut slot)) = (self.scoring.lock(), self.slot.lock()) {
            scoring.end(&self.model, &mut slot);
        }
    }
}

/// A model's importance statistics (`Model.collect_importance`), opaque to Python.
#[pyclass(frozen, module = "colibri._engine")]
struct Importance {
    inner: Arc<crate::calib::Importance>,
}

#[pymethods]
impl Importance {
    /// Calibration tokens the statistics come from.
    #[getter]
    fn tokens(&self) -> usize {
        self.inner.tokens
    }

    /// The resident matrix `name`'s row segments: `(first row, rows, weight per column)`.
    fn resident(&self, name: &str) -> Vec<(usize, usize, Vec<f32>)> {
        self.inner.resident.get(name).map_or_else(Vec::new, |segs| {
            segs.iter()
                .map(|s| (s.first_row, s.rows, s.weights.clone()))
                .collect()
        })
    }

    /// Part `part` (0 gate, 1 up, 2 down) of routed expert `expert` of model layer `layer`.
    fn expert(&self, layer: usize, expert: usize, part: usize) -> Option<Vec<f32>> {
        (part < 3)
            .then(|| self.inner.expert(layer, expert, part).map(<[f32]>::to_vec))
            .flatten()
    }
}

/// Converts a Hugging Face checkpoint directory; returns a summary dict.
/// `keep_f32`: resident matrices kept at f32; `q8`: resident matrices stored at 8 bits (`None`:
/// the default, attention `v` and `o` in an int4 conversion; an empty list: none).
/// `importance`: statistics of this checkpoint (`Model.collect_importance` on its f32
/// conversion) to weight the int4 error by, recorded in the manifest with the calibration
/// text's `calibration_sha256` and the chunk length `calibration_ctx`. `grid`: `linear` or
/// `table`, the int4 matrices' grid.
#[pyfunction]
#[pyo3(signature = (hf_dir, out_dir, quant="int4", progress=false, keep_f32=Vec::new(), q8=None, importance=None, calibration_sha256=String::new(), calibration_ctx=0, q4_0_rounding=false, grid="linear"))]
#[allow(clippy::too_many_arguments)]
fn convert_checkpoint<'py>(
    py: Python<'py>,
    hf_dir: PathBuf,
    out_dir: PathBuf,
    quant: &str,
    progress: bool,
    keep_f32: Vec<String>,
    q8: Option<Vec<String>>,
    importance: Option<PyRef<'py, Importance>>,
    calibration_sha256: String,
    calibration_ctx: usize,
    q4_0_rounding: bool,
    grid: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let q = Quant::parse(quant).ok_or_else(|| {
        PyValueError::new_err(format!("unknown quantization `{quant}` (int4, f32)"))
    })?;
    let grid = parse_grid(grid)?;
    if grid == crate::quant::Grid::Table && q != Quant::Int4 {
        return Err(PyValueError::new_err(
            "the table grid is an int4 format; an f32 conversion has no grid",
        ));
    }
    let calib = importance.map(|i| convert::Calibration {
        importance: (*i.inner).clone(),
        info: crate::format::CalibrationInfo {
            sha256: calibration_sha256,
            tokens: i.inner.tokens,
            ctx: calibration_ctx,
        },
    });
    let summary = py
        .detach(|| {
            let mut report = |done: usize, total: usize, what: &str| {
                if progress {
                    show_progress("converting", done, total, what);
                }
            };
            let prec = convert::Precisions {
                keep_f32,
                q8,
                q4_0_scales: q4_0_rounding,
                rounded_as: None,
                grid,
            };
            convert::convert_calibrated(&hf_dir, &out_dir, q, &prec, calib.as_ref(), &mut report)
        })
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("architecture", summary.architecture)?;
    d.set_item("resident_bytes", summary.resident_bytes)?;
    d.set_item("expert_bytes", summary.expert_bytes)?;
    d.set_item("tensors", summary.tensors)?;
    d.set_item("skipped_tensors", summary.skipped)?;
    Ok(d)
}

/// The int4 bytes of `data` (`rows x cols` little-endian f32), for tests and benchmarks: with
/// `weights` (`cols` f32: the same for every row) the error weighted per column; with `rtn`,
/// Q4_0's max-abs round-to-nearest instead of the search.
#[pyfunction]
#[pyo3(signature = (data, rows, cols, weights=None, rtn=false))]
fn quantize_q4<'py>(
    py: Python<'py>,
    data: &[u8],
    rows: usize,
    cols: usize,
    weights: Option<&[u8]>,
    rtn: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let floats = |b: &[u8], n: usize, what: &str| -> PyResult<Vec<f32>> {
        if Some(b.len()) != n.checked_mul(4) {
            return Err(PyValueError::new_err(format!(
                "{what}: {} bytes, expected {n} f32",
                b.len()
            )));
        }
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    };
    let w = floats(data, rows.saturating_mul(cols), "data")?;
    let wt = weights.map(|b| floats(b, cols, "weights")).transpose()?;
    if wt
        .as_ref()
        .is_some_and(|v| v.iter().any(|x| !x.is_finite() || *x < 0.0))
    {
        return Err(PyValueError::new_err("weights must be finite and >= 0"));
    }
    let out = match (&wt, rtn) {
        (_, true) => crate::quant::quantize_q4_0_rtn(&w, rows, cols),
        (None, false) => crate::quant::quantize_q4(&w, rows, cols),
        (Some(v), false) => {
            let f = |_: usize| Some(v.as_slice());
            crate::quant::quantize_q4_weighted(&w, rows, cols, &f)
        }
    };
    Ok(PyBytes::new(py, &out))
}

/// The int4 grid named `linear` or `table`.
fn parse_grid(name: &str) -> PyResult<crate::quant::Grid> {
    match name {
        "linear" => Ok(crate::quant::Grid::Linear),
        "table" => Ok(crate::quant::Grid::Table),
        _ => Err(PyValueError::new_err(format!(
            "unknown grid `{name}` (linear, table)"
        ))),
    }
}

/// The `rows x cols` f32 values (little-endian bytes) of the int4 matrix `data`, its codes on
/// `grid` (`linear`: dtype q4, `table`: q4t).
#[pyfunction]
#[pyo3(signature = (data, rows, cols, grid="linear"))]
fn dequantize_q4<'py>(
    py: Python<'py>,
    data: &[u8],
    rows: usize,
    cols: usize,
    grid: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let m = crate::quant::Q4Matrix::on_grid(data, rows, cols, parse_grid(grid)?)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, bytemuck::cast_slice(&m.dequantize())))
}

/// Re-encodes the format-v2 model directory `src` as v3 into the new directory `dst`
/// (lossless: a permutation of each int4 row's nibble bytes); with `progress`, the expert
/// records done are shown on stderr.
#[pyfunction]
#[pyo3(signature = (src, dst, progress=false))]
fn upgrade_model<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let s = py
        .detach(|| {
            let mut report = |done: usize, total: usize, what: &str| {
                if progress {
                    show_progress("upgrading", done, total, what);
                }
            };
            crate::upgrade::upgrade(&src, &dst, &mut report)
        })
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("matrices", s.matrices)?;
    d.set_item("bytes", s.bytes)?;
    Ok(d)
}

/// One progress line on stderr, redrawn in place (`verb pct% (done/total) what`).
fn show_progress(verb: &str, done: usize, total: usize, what: &str) {
    use std::io::Write;
    let pct = (done * 100).checked_div(total).unwrap_or(100);
    let mut e = std::io::stderr().lock();
    let _ = write!(e, "\r\x1b[2K{verb} {pct:3}% ({done}/{total}) {what}");
    if done == total {
        let _ = writeln!(e);
    }
}

/// Name of the kernel chosen for this CPU (after any `COLI_KERNEL` override).
/// What the model in `path` takes in RAM, read from its manifest without loading its weights:
/// `resident_bytes` (its resident file, and the copies of it the model makes at load: MLA's
/// `kv_b` by columns) and `expert_bytes` (its experts file), `expert_record_bytes` (one expert record,
/// the expert cache's unit; 0 without routed experts), `kv_bytes_per_token` and
/// `state_bytes_per_slot` (as `Model.info` gives them once loaded) and `context_length` (the
/// model's own). The server sizes its RAM budget from it before a load.
#[pyfunction]
fn memory_plan<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let manifest = crate::format::read_manifest(&path).map_err(to_py)?;
    let cfg = crate::config::ModelConfig::from_hf(&manifest.config).map_err(to_py)?;
    let dtype = crate::model::kv_dtype(manifest.quantization.kind).map_err(to_py)?;
    let cache = crate::model::layers::with_states(
        &cfg,
        crate::kv::KvCache::new(&crate::model::layers::kv_layout(&cfg), dtype),
    );
    let size = |name: &str| -> PyResult<u64> {
        let p = path.join(name);
        std::fs::metadata(&p)
            .map(|m| m.len())
            .map_err(|e| PyValueError::new_err(format!("{}: {e}", p.display())))
    };
    let d = PyDict::new(py);
    let copies = crate::model::layers::mla::kv_b_columns_bytes(&manifest);
    d.set_item("resident_bytes", size(&manifest.resident.file)? + copies)?;
    match &manifest.experts {
        Some(x) => {
            d.set_item("expert_bytes", size(&x.file)?)?;
            d.set_item("expert_record_bytes", x.record_size)?;
        }
        None => {
            d.set_item("expert_bytes", 0)?;
            d.set_item("expert_record_bytes", 0)?;
        }
    }
    d.set_item("kv_bytes_per_token", cache.bytes_per_token())?;
    d.set_item("state_bytes_per_slot", cache.state_bytes())?;
    d.set_item("context_length", cfg.max_positions)?;
    Ok(d)
}

/// The `tokenizer.json` (as JSON text) that conversion writes for the checkpoint `hf_dir` when
/// it ships `tiktoken.model` instead of one (Kimi's), for a model of `vocab_size` tokens.
#[pyfunction]
fn tiktoken_tokenizer(hf_dir: PathBuf, vocab_size: usize) -> PyResult<String> {
    match crate::convert::tiktoken::from_checkpoint(&hf_dir, vocab_size).map_err(to_py)? {
        Some(tj) => Ok(tj.to_string()),
        None => Err(PyValueError::new_err(format!(
            "{}: no {} in the directory",
            hf_dir.display(),
            crate::convert::tiktoken::RANKS_FILE
        ))),
    }
}

/// The config (as JSON text) of the model a checkpoint's config.json (`config`, JSON text)
/// describes: itself for a text model, its text model's for a multimodal wrapper colibri serves
/// as text (Kimi K2.5's), as conversion reads it.
#[pyfunction]
fn text_model_config(config: &str) -> PyResult<String> {
    let v: serde_json::Value = serde_json::from_str(config)
        .map_err(|e| PyValueError::new_err(format!("config.json: invalid JSON: {e}")))?;
    let (text, _) = convert::text_only::text_model(&v).map_err(to_py)?;
    Ok(text.to_string())
}

#[pyfunction]
fn default_kernel() -> &'static str {
    crate::quant::kernel().name()
}

/// Kernels this CPU can run.
#[pyfunction]
fn available_kernels() -> Vec<&'static str> {
    [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512Vnni]
        .into_iter()
        .filter(|k| k.available())
        .map(|k| k.name())
        .collect()
}

/// The architectures the engine runs (`architectures[0]` of a checkpoint's config), each with
/// the gateway's chat family for it when the chat template names none.
#[pyfunction]
fn architectures() -> Vec<(&'static str, &'static str)> {
    crate::model::registry::FAMILIES
        .iter()
        .map(|f| (f.hf_name, f.chat_family))
        .collect()
}

#[pymodule]
fn _engine(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_class::<TokenStream>()?;
    m.add_class::<ScoreStream>()?;
    m.add_class::<Importance>()?;
    m.add_function(wrap_pyfunction!(convert_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_q4, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_q4, m)?)?;
    m.add_function(wrap_pyfunction!(upgrade_model, m)?)?;
    m.add_function(wrap_pyfunction!(default_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(tiktoken_tokenizer, m)?)?;
    m.add_function(wrap_pyfunction!(text_model_config, m)?)?;
    m.add_function(wrap_pyfunction!(memory_plan, m)?)?;
    m.add_function(wrap_pyfunction!(available_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(architectures, m)?)?;
    m.add("FORMAT_VERSION", crate::format::FORMAT_VERSION)?;
    Ok(())
}
