//! The int4 quantizer against Q4_0 on random shapes drawn per run (issue 33): for every
//! committed fixture, new sizes are drawn for its config (hidden, feed-forward, latent and
//! low-rank widths: any integer, so group padding is exercised too), a checkpoint of those
//! shapes is written with each tensor drawn like the fixture's own (its mean and spread), and
//! colibri's int4 (`--pure`: every matrix int4) is compared with the same conversion rounding
//! every group as Q4_0 does ([`Precisions::q4_0_scales`]), both against the f32 conversion, on
//! the same engine. The seed is printed; `COLIBRI_SHAPE_SEED=N` repeats a run.

use std::fs;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::{convert_with, expert_shape, family_plan, Checkpoint, Precisions, MLP_PARTS};
use crate::config::ModelConfig;
use crate::format::Quant;
use crate::quant;
use crate::testutil::{committed_fixtures, fixture, prompt_logits, rel_err, scratch_dir};

/// Size fields redrawn when a config has them, and the range each is drawn from.
const SIZES: [(&str, usize, usize); 7] = [
    ("hidden_size", 96, 320),
    ("intermediate_size", 64, 320),
    ("moe_intermediate_size", 32, 160),
    ("shared_expert_intermediate_size", 32, 128),
    ("kv_lora_rank", 32, 128),
    ("q_lora_rank", 32, 128),
    ("o_lora_rank", 16, 64),
];

/// The prompt sets a committed fixture is scored on: 8 prompts of 24 tokens twice, 8 of 48.
const FIXTURE_SETS: [(u32, u32); 3] = [(8, 24), (8, 24), (8, 48)];
/// The prompt set a drawn shape is scored on: 16 prompts of 32 tokens.
const DRAWN_SETS: [(u32, u32); 1] = [(16, 32)];

fn normal(rng: &mut StdRng) -> f32 {
    // Box-Muller: the crate has no distributions dependency for one test.
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    let v: f64 = rng.random_range(0.0..1.0);
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// The fixture's config with its sizes redrawn; a draw the family refuses (a width its heads
/// must divide, say) is drawn again.
fn draw_config(arch: &str, rng: &mut StdRng) -> serde_json::Value {
    let base: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(fixture(arch).join("config.json")).unwrap())
            .unwrap();
    for _ in 0..100 {
        let mut c = base.clone();
        for (field, lo, hi) in SIZES {
            if c.get(field).is_some_and(|v| v.is_u64()) {
                c[field] = rng.random_range(lo..=hi).into();
            }
        }
        if ModelConfig::from_hf(&c).is_ok() {
            return c;
        }
    }
    panic!("{arch}: no drawn config accepted in 100 draws");
}

/// Mean and standard deviation of a fixture tensor (`None`: the fixture has no such tensor).
fn stats(ck: &Checkpoint, name: &str) -> Option<(f32, f32)> {
    let (v, _) = ck.read_any(name).ok()?;
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    Some((mean as f32, var.sqrt() as f32))
}

/// Writes a checkpoint of `cfg`'s shapes next to the fixture's tokenizer, each tensor drawn
/// with the fixture's statistics for it (routed experts: those of the fixture's first expert
/// of the first MoE layer, or N(0, 0.02) when they are stored fused).
fn write_checkpoint(arch: &str, cfg_json: &serde_json::Value, dir: &Path, rng: &mut StdRng) {
    let src = fixture(arch);
    let base_json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let base_cfg = ModelConfig::from_hf(&base_json).unwrap();
    let ck = Checkpoint::open(&src, &base_json, base_cfg.family.checkpoint_name, None).unwrap();
    let cfg = ModelConfig::from_hf(cfg_json).unwrap();
    let plan = family_plan(&cfg);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>, Dtype)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for spec in &plan.resident {
        if !seen.insert(spec.hf.clone()) || (spec.optional && !ck.has(&spec.hf)) {
            continue;
        }
        let shape = spec.source_shape();
        let n: usize = shape.iter().product();
        if spec.int_table {
            // An expert id per token (DeepSeek-V4's hash layers): the fixture's own table when
            // the vocabulary is the same, else drawn.
            let table: Vec<i64> = match ck.read_any(&spec.hf) {
                Ok((v, s)) if s == shape => v.iter().map(|&x| x as i64).collect(),
                _ => (0..n)
                    .map(|_| rng.random_range(0..cfg.num_experts as i64))
                    .collect(),
            };
            let bytes = table.iter().flat_map(|x| x.to_le_bytes()).collect();
            tensors.push((spec.hf.clone(), shape, bytes, Dtype::I64));
            continue;
        }
        let (mean, std) = stats(&ck, &spec.hf).unwrap_or((0.0, 0.02));
        let values: Vec<f32> = (0..n).map(|_| mean + std * normal(rng)).collect();
        tensors.push((spec.hf.clone(), shape, f32_bytes(&values), Dtype::F32));
    }
    for (_, src) in &plan.expert_layers {
        for e in 0..cfg.num_experts {
            for part in MLP_PARTS {
                let name = format!("{}.{e}.{part}_proj.weight", src.prefix);
                let first = format!("{}.0.{part}_proj.weight", plan.expert_layers[0].1.prefix);
                let (mean, std) = stats(&ck, &first).unwrap_or((0.0, 0.02));
                let shape = expert_shape(&cfg, part);
                let n: usize = shape.iter().product();
                let values: Vec<f32> = (0..n).map(|_| mean + std * normal(rng)).collect();
                tensors.push((name, shape, f32_bytes(&values), Dtype::F32));
            }
        }
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, b, d)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(cfg_json).unwrap(),
    )
    .unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        if src.join(f).exists() {
            fs::copy(src.join(f), dir.join(f)).unwrap();
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn convert(hf: &Path, out: PathBuf, quant: Quant, prec: &Precisions) -> PathBuf {
    convert_with(hf, &out, quant, prec, &mut |_, _, _| {}).unwrap();
    out
}

/// The worst a single drawn shape may land above Q4_0, and the most the run's geometric mean
/// ratio may reach. Per group the quantizer's weight error never exceeds Q4_0's (`quant::q4`'s
/// tests), but the logits of these tiny random models are no linear function of it: how two
/// rounding patterns' errors line up through routing and top-k choices is chance per draw.
/// Measured over 238 draws (17 seeds): ratios 0.92-1.027, 13 above 1.0, per-run geometric
/// means 0.964-0.984 (spread ~0.006: 1.0 is 4 of them away, so the test is not flaky). A
/// quantizer no better than Q4_0 would centre on 1.0 and fail the mean every other run. Six
/// times the tokens per draw narrows the spread across draws only from 0.016 to 0.0125 (112
/// draws; one stayed above 1.0): a draw's ratio is mostly its weights', so no token count
/// makes a strict per-draw 1.0 hold (docs/PERFORMANCE.md). The table grid (`--grid table`),
/// over 714 draws (51 seeds): 0.953 geometric mean, none above 1.0, the largest 0.9995 (the
/// linear grid on the same draws: 0.972, 19 above, up to 1.031); held to the same bounds.
const WORST_DRAW: f64 = 1.05;
const MEAN_RATIO: f64 = 1.0;

#[test]
fn int4_below_q4_0_on_random_shapes() {
    let seed: u64 = std::env::var("COLIBRI_SHAPE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::make_rng::<StdRng>().random());
    println!("random shapes: COLIBRI_SHAPE_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut ratios, mut table_ratios) = (Vec::new(), Vec::new());
    for arch in &committed_fixtures() {
        let arch = arch.as_str();
        let d = scratch_dir("shapes", arch);
        let cfg = draw_config(arch, &mut rng);
        let hf = d.join("hf");
        fs::create_dir_all(&hf).unwrap();
        write_checkpoint(arch, &cfg, &hf, &mut rng);
        let (e_int4, e_table, e_q4_0) = int4_and_q4_0_errors(&hf, &d, &DRAWN_SETS);
        let sizes: Vec<String> = SIZES
            .iter()
            .filter_map(|(f, _, _)| {
                let v = cfg.get(*f)?.as_u64()?;
                Some(format!("{f}={v}"))
            })
            .collect();
        let (ratio, table) = (e_int4 / e_q4_0, e_table / e_q4_0);
        println!(
            "{arch} [{}]: int4 {e_int4:.4} ({ratio:.3}x), table {e_table:.4} ({table:.3}x) vs \
             Q4_0 {e_q4_0:.4}",
            sizes.join(" ")
        );
        for (grid, r) in [("int4", ratio), ("table-grid int4", table)] {
            assert!(
                r <= WORST_DRAW,
                "seed {seed}, {arch}: {grid} {r:.3}x Q4_0's error"
            );
        }
        ratios.push(ratio);
        table_ratios.push(table);
        fs::remove_dir_all(&d).unwrap();
    }
    let mean = geometric_mean(&ratios);
    let above = ratios.iter().filter(|&&r| r > 1.0).count();
    let table_mean = geometric_mean(&table_ratios);
    let table_above = table_ratios.iter().filter(|&&r| r > 1.0).count();
    println!(
        "geometric mean {mean:.3}x, {above} of {} above 1.0; table grid {table_mean:.3}x, \
         {table_above} above 1.0",
        ratios.len()
    );
    assert!(mean < MEAN_RATIO, "seed {seed}: mean ratio {mean:.3}");
    assert!(
        table_mean < MEAN_RATIO,
        "seed {seed}: table grid's mean ratio {table_mean:.3}"
    );
}

/// Every committed fixture, as it is: colibri's int4 within 1.0x Q4_0's error on the same
/// engine, on the linear grid and on the table grid, over three prompt sets (8 prompts of 24
/// tokens twice, 8 of 48).
#[test]
fn int4_no_worse_than_q4_0_on_every_fixture() {
    let mut worse = Vec::new();
    for arch in &committed_fixtures() {
        let arch = arch.as_str();
        let d = scratch_dir("q4_0-fixture", arch);
        let (e_int4, e_table, e_q4_0) = int4_and_q4_0_errors(&fixture(arch), &d, &FIXTURE_SETS);
        println!(
            "{arch}: int4 {e_int4:.4} ({:.3}x), table {e_table:.4} ({:.3}x) vs Q4_0 {e_q4_0:.4}",
            e_int4 / e_q4_0,
            e_table / e_q4_0
        );
        for (what, e) in [("int4", e_int4), ("table", e_table)] {
            if e > e_q4_0 {
                worse.push(format!("{arch} {what}: {e:.4} > {e_q4_0:.4}"));
            }
        }
        fs::remove_dir_all(&d).unwrap();
    }
    assert!(worse.is_empty(), "{worse:?}");
}

/// The relative logit errors of the int4 (`--pure`) conversions of `hf` on the linear and the
/// table grid and of its Q4_0-rounded one, against its f32 conversion, over `(prompts,
/// tokens)` sets, converted under `work`: `(linear, table, Q4_0)`.
fn int4_and_q4_0_errors(hf: &Path, work: &Path, sets: &[(u32, u32)]) -> (f64, f64, f64) {
    let q4_0 = Precisions {
        q4_0_scales: true,
        ..Precisions::pure()
    };
    let table = Precisions {
        grid: quant::Grid::Table,
        ..Precisions::pure()
    };
    let f32_dir = convert(hf, work.join("f32"), Quant::F32, &Precisions::default());
    let reference = sets_logits(&f32_dir, sets);
    let error = |dir: &str, prec: &Precisions| {
        let d = convert(hf, work.join(dir), Quant::Int4, prec);
        rel_err(&sets_logits(&d, sets), &reference)
    };
    (
        error("int4", &Precisions::pure()),
        error("table", &table),
        error("q4_0", &q4_0),
    )
}

/// The logits of `dir`'s model over the `(prompts, tokens)` sets, set `i` drawn with seed `i`.
fn sets_logits(dir: &Path, sets: &[(u32, u32)]) -> Vec<f32> {
    let mut logits = Vec::new();
    for (i, &(n, len)) in sets.iter().enumerate() {
        logits.extend(prompt_logits(dir, n, len, i as u32));
    }
    logits
}

/// The geometric mean of `ratios`.
fn geometric_mean(ratios: &[f64]) -> f64 {
    (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp()
}

/// What a table of 16 uneven levels would do to the logit error, before any kernel reads one
/// (issue 33; a measurement, run by hand, docs/PERFORMANCE.md): each committed fixture and
/// `COLIBRI_FORMAT_DRAWS` (default 3) redrawn shapes of it, converted at f32 with every int4
/// matrix rounded as Q4_0, colibri's int4 and the two tables of [`super::rounding`] would
/// round it (`Precisions::rounded_as`: f32 activations, so the weights' rounding alone), each
/// relative logit error against the plain f32 conversion's over it, as a ratio to Q4_0's.
///
///     cargo test --release -p colibri-engine --lib format_rounding_against_q4_0 -- --ignored --nocapture
#[test]
#[ignore = "a measurement (~5 minutes on 2 cores), not a check"]
fn format_rounding_against_q4_0() {
    use super::rounding::{Rounding, LEVELS_5_BIT, LEVELS_6_BIT};
    let arms = [
        ("Q4_0", Rounding::Q4_0),
        ("int4", Rounding::Int4),
        ("5-bit table", Rounding::Levels(LEVELS_5_BIT.to_vec())),
        ("6-bit table", Rounding::Levels(LEVELS_6_BIT.to_vec())),
    ];
    let draws: usize = std::env::var("COLIBRI_FORMAT_DRAWS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let seed: u64 = std::env::var("COLIBRI_SHAPE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    println!("format rounding: COLIBRI_SHAPE_SEED={seed}, {draws} draws a fixture");
    let mut rng = StdRng::seed_from_u64(seed);
    // Per arm: (fixtures' ratios, drawn shapes' ratios).
    let mut ratios = vec![(Vec::new(), Vec::new()); arms.len()];
    for arch in &committed_fixtures() {
        let arch = arch.as_str();
        for draw in 0..=draws {
            let d = scratch_dir("format-rounding", arch);
            let (hf, sets) = if draw == 0 {
                (fixture(arch), &FIXTURE_SETS[..])
            } else {
                let hf = d.join("hf");
                fs::create_dir_all(&hf).unwrap();
                let cfg = draw_config(arch, &mut rng);
                write_checkpoint(arch, &cfg, &hf, &mut rng);
                (hf, &DRAWN_SETS[..])
            };
            let f32_dir = convert(&hf, d.join("f32"), Quant::F32, &Precisions::default());
            let reference = sets_logits(&f32_dir, sets);
            let errs: Vec<f64> = arms
                .iter()
                .map(|(name, how)| {
                    let prec = Precisions {
                        rounded_as: Some(how.clone()),
                        ..Precisions::pure()
                    };
                    let dir = convert(&hf, d.join(name.replace(' ', "-")), Quant::F32, &prec);
                    rel_err(&sets_logits(&dir, sets), &reference)
                })
                .collect();
            let line: Vec<String> = arms
                .iter()
                .zip(&errs)
                .skip(1)
                .map(|((name, _), e)| format!("{name} {:.3}x", e / errs[0]))
                .collect();
            println!(
                "{arch} {}: Q4_0 {:.4}; {}",
                if draw == 0 { "fixture" } else { "drawn" },
                errs[0],
                line.join(", ")
            );
            for (i, e) in errs.iter().enumerate() {
                let r = e / errs[0];
                if draw == 0 {
                    ratios[i].0.push(r);
                } else {
                    ratios[i].1.push(r);
                }
            }
            fs::remove_dir_all(&d).unwrap();
        }
    }
    let summary = |v: &[f64]| {
        let mean = geometric_mean(v);
        let max = v.iter().cloned().fold(0.0, f64::max);
        let above = v.iter().filter(|&&r| r > 1.0).count();
        format!(
            "geometric mean {mean:.3}x, max {max:.3}x, {above} of {} above 1.0",
            v.len()
        )
    };
    for ((name, _), (fixtures, drawn)) in arms.iter().zip(&ratios).skip(1) {
        println!(
            "{name}: fixtures {}; drawn {}",
            summary(fixtures),
            summary(drawn)
        );
    }
}
