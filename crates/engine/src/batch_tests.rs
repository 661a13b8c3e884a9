//! Generations stepped together ([`crate::engine::step_batch`]) give exactly the tokens each
//! one gets alone, on every fixture family, quantization, kernel and expert placement.

use crate::engine::{step_batch, GenerateOptions, Generation, Step};
use crate::format::Quant;
use crate::model::Model;
use crate::quant::Kernel;
use crate::slots::Slot;
use crate::store::ExpertOptions;

/// A generation's prompt, options and the batch step it joins at.
struct Case {
    prompt: Vec<u32>,
    max_tokens: usize,
    temperature: f32,
    seed: Option<u64>,
    starts_at: usize,
}

fn cases(vocab: u32) -> Vec<Case> {
    let prompt = |n: u32, mul: u32| (0..n).map(|i| (i * mul + 3) % vocab).collect::<Vec<_>>();
    vec![
        Case {
            prompt: prompt(5, 31),
            max_tokens: 9,
            temperature: 0.0,
            seed: None,
            starts_at: 0,
        },
        // A longer prompt (several prefill steps) joining while the first decodes, sampled.
        Case {
            prompt: prompt(40, 17),
            max_tokens: 12,
            temperature: 0.9,
            seed: Some(7),
            starts_at: 2,
        },
        Case {
            prompt: prompt(70, 13),
            max_tokens: 6,
            temperature: 0.0,
            seed: None,
            starts_at: 5,
        },
    ]
}

fn generation(c: &Case) -> Generation {
    let opts = GenerateOptions {
        max_tokens: c.max_tokens,
        temperature: c.temperature,
        top_p: 1.0,
        stop_token_ids: Vec::new(),
        seed: c.seed,
    };
    Generation::new(c.prompt.clone(), opts).unwrap()
}

fn alone(model: &Model, c: &Case) -> Vec<u32> {
    let mut slot = Slot::new(model);
    let mut gen = generation(c);
    let mut out = Vec::new();
    while let Some(t) = gen.next_token(model, &mut slot).unwrap() {
        out.push(t);
    }
    out
}

/// Every case stepped in one batch from its start step on; returns each one's tokens and the
/// most generations any step ran. While another prompt prefills, a decoding generation gets a
/// token at every step (it never waits for that prefill to finish).
fn together(model: &Model, cases: &[Case]) -> (Vec<Vec<u32>>, usize) {
    let mut gens: Vec<Generation> = cases.iter().map(generation).collect();
    let mut slots: Vec<Slot> = cases.iter().map(|_| Slot::new(model)).collect();
    let mut out = vec![Vec::new(); cases.len()];
    let mut ended = vec![false; cases.len()];
    let mut widest = 0;
    for step in 0.. {
        let live: Vec<usize> = (0..cases.len())
            .filter(|&i| !ended[i] && cases[i].starts_at <= step)
            .collect();
        if live.is_empty() && ended.iter().all(|&e| e) {
            break;
        }
        widest = widest.max(live.len());
        let mut work: Vec<(&mut Generation, &mut Slot)> = gens
            .iter_mut()
            .zip(slots.iter_mut())
            .enumerate()
            .filter(|(i, _)| live.contains(i))
            .map(|(_, (g, s))| (g, s))
            .collect();
        let decoding: Vec<bool> = live.iter().map(|&i| !out[i].is_empty()).collect();
        let steps: Vec<Step> = step_batch(model, &mut work)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        let prefilling = steps.iter().any(|s| matches!(s, Step::Prefilled { .. }));
        for ((&i, step), was_decoding) in live.iter().zip(&steps).zip(decoding) {
            if prefilling && was_decoding {
                assert!(
                    matches!(step, Step::Token(_) | Step::End),
                    "generation {i} stalled while another prefilled: {step:?}"
                );
            }
            match *step {
                Step::Token(t) => out[i].push(t),
                Step::Prefilled { .. } => {}
                Step::End => ended[i] = true,
            }
        }
    }
    (out, widest)
}

fn kernels() -> Vec<Kernel> {
    Kernel::ALL.into_iter().filter(|k| k.available()).collect()
}

/// Three interleaved generations (prompts of 5, 40 and 70 tokens prefilled in 16-position
/// steps, joining at steps 0, 2 and 5; one sampled with a seed) give each one's tokens alone,
/// on every fixture family, in int4 and f32, on every kernel, with every expert resident and
/// with a budget of one expert per layer.
#[test]
fn interleaved_generations_equal_each_one_alone() {
    let archs = [
        "olmoe",
        "qwen3_moe",
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v3_noqlora",
        "glm_moe_dsa",
        "glm_moe_dsa_shared",
        "glm_moe_dsa_yarn",
        "deepseek_v4",
        "qwen3_next",
        "kimi_linear",
    ];
    for arch in archs {
        for quant in [Quant::Int4, Quant::F32] {
            let root = crate::testutil::scratch_dir("batch", &format!("{arch}-{quant:?}"));
            let d = root.join("model");
            let hf = crate::testutil::fixture(arch);
            crate::convert::convert(&hf, &d, quant, &mut |_, _, _| {}).unwrap();
            let probe = Model::load(&d, Some(1)).unwrap();
            let x = probe.manifest.experts.as_ref().unwrap();
            let one_per_layer = (x.layers.len() * x.record_size) as u64;
            drop(probe);
            let placements = [
                ExpertOptions::default(),
                ExpertOptions {
                    ram_bytes: Some(one_per_layer),
                    ..Default::default()
                },
            ];
            for opts in &placements {
                let mut model = Model::load_with(&d, Some(2), opts).unwrap();
                model.set_prefill_chunk(16);
                let cases = cases(model.cfg.vocab_size as u32);
                for k in kernels() {
                    model.set_kernel(k);
                    let expected: Vec<Vec<u32>> = cases.iter().map(|c| alone(&model, c)).collect();
                    let (got, widest) = together(&model, &cases);
                    let what = format!("{arch} {quant:?} {} ram {:?}", k.name(), opts.ram_bytes);
                    assert_eq!(widest, 3, "{what}: the three never ran together");
                    assert_eq!(got, expected, "{what}");
                    for (c, toks) in cases.iter().zip(&got) {
                        assert_eq!(toks.len(), c.max_tokens, "{what}");
                    }
                }
            }
            std::fs::remove_dir_all(&root).unwrap();
        }
    }
}

/// One generation's bad input fails it alone: the others in the step go on.
#[test]
fn a_bad_prompt_fails_only_its_own_generation() {
    let root = crate::testutil::scratch_dir("batch", "bad");
    let d = root.join("model");
    crate::convert::convert(
        &crate::testutil::fixture("olmoe"),
        &d,
        Quant::Int4,
        &mut |_, _, _| {},
    )
    .unwrap();
    let model = Model::load(&d, Some(2)).unwrap();
    std::fs::remove_dir_all(&root).unwrap();
    let vocab = model.cfg.vocab_size as u32;
    let good = Case {
        prompt: vec![1, 2, 3],
        max_tokens: 4,
        temperature: 0.0,
        seed: None,
        starts_at: 0,
    };
    let expected = alone(&model, &good);
    let bad = Case {
        prompt: vec![1, vocab + 5],
        ..good
    };
    let good = Case {
        prompt: vec![1, 2, 3],
        ..bad
    };
    let (mut g1, mut g2) = (generation(&good), generation(&bad));
    let (mut s1, mut s2) = (Slot::new(&model), Slot::new(&model));
    let mut r = step_batch(&model, &mut [(&mut g1, &mut s1), (&mut g2, &mut s2)]);
    let err = r.pop().unwrap().unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    let Step::Token(first) = r.pop().unwrap().unwrap() else {
        panic!("expected a token")
    };
    let mut got = vec![first];
    while let Some(t) = g1.next_token(&model, &mut s1).unwrap() {
        got.push(t);
    }
    assert_eq!(got, expected);
}
