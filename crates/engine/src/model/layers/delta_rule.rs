//! The gated delta rule for one value head over consecutive positions, in its two forms.
//!
//! Per position `t` (q already L2-normed and scaled, k L2-normed, `g` the log decay: one value,
//! or one per key channel for KDA, `beta` a scalar), with the head's state `S` (`key_dim x
//! value_dim`, row-major):
//! `S = diag(exp(g)) S; delta = (v - S^T k) * beta; S += k delta^T; o = S^T q`.
//!
//! - [`recurrent`]: the rule as written, one position at a time (decode, short steps).
//! - [`chunked`]: the rule regrouped by chunks of positions as transformers' `chunk_*` forms
//!   compute it (the WY form of the chunk's products: a triangular solve within the chunk, then
//!   matrix products with `S` once per chunk instead of once per position). It reads `S` far
//!   less often but does more arithmetic, and with a decay per key channel (KDA) every pair of
//!   positions in a chunk needs `key_dim` exponentials. On a CPU the recurrent form measured
//!   faster at every step length (`speed::forms_per_position`), so the engine runs it unless
//!   `COLI_DELTA_CHUNKED` asks otherwise (`layers::delta::DELTA_CHUNKED_FROM`).
//!
//! Both are compiled three times ([`Kernel`]): portable, AVX2 and AVX-512, the same source whose
//! element-wise loops the compiler vectorises; each form gives the same bits on every kernel
//! (no reassociation, no fused multiply-adds).

use crate::attention::Kernel;

/// Rows of one per-position input: position `t`'s row is `data[offset + t * stride..][..width]`.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub stride: usize,
    pub width: usize,
}

impl<'a> Rows<'a> {
    #[inline(always)]
    fn at(&self, t: usize) -> &'a [f32] {
        let s = self.offset + t * self.stride;
        &self.data[s..s + self.width]
    }
}

/// One value head's inputs over `len` consecutive positions.
#[derive(Clone, Copy)]
pub struct HeadInputs<'a> {
    pub len: usize,
    /// `key_dim` wide.
    pub q: Rows<'a>,
    /// `key_dim` wide.
    pub k: Rows<'a>,
    /// `value_dim` wide.
    pub v: Rows<'a>,
    /// The log decay: 1 wide (per head) or `key_dim` wide (per key channel).
    pub g: Rows<'a>,
    /// 1 wide.
    pub beta: Rows<'a>,
}

/// Which form runs a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    Recurrent,
    /// Chunks of this many positions.
    Chunked(usize),
}

/// Positions per chunk of the chunked form (transformers' and FLA's 64).
pub const CHUNK: usize = 64;

impl Form {
    /// The form for a step of `len` positions, given the shortest step that runs chunked
    /// (`None`: never).
    pub fn for_step(len: usize, chunked_from: Option<usize>) -> Form {
        match chunked_from {
            Some(min) if len >= min => Form::Chunked(CHUNK),
            _ => Form::Recurrent,
        }
    }
}

/// Runs `x` through the rule from state `s` (advanced in place); writes each position's output
/// (`value_dim` wide) to `out`.
pub fn run(kernel: Kernel, form: Form, x: &HeadInputs, s: &mut [f32], out: &mut [f32]) {
    assert_eq!(s.len(), x.k.width * x.v.width);
    assert_eq!(out.len(), x.len * x.v.width);
    assert!(x.g.width == 1 || x.g.width == x.k.width);
    assert!(
        Kernel::available().contains(&kernel),
        "{kernel:?} not on this CPU"
    );
    match kernel {
        Kernel::Portable => body(form, x, s, out),
        // SAFETY: the CPU has the form's features (asserted above).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { body_avx2(form, x, s, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { body_avx512(form, x, s, out) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn body_avx512(form: Form, x: &HeadInputs, s: &mut [f32], out: &mut [f32]) {
    body(form, x, s, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn body_avx2(form: Form, x: &HeadInputs, s: &mut [f32], out: &mut [f32]) {
    body(form, x, s, out)
}

#[inline(always)]
fn body(form: Form, x: &HeadInputs, s: &mut [f32], out: &mut [f32]) {
    match form {
        Form::Recurrent => recurrent(x, s, out),
        Form::Chunked(c) => chunked(x, s, out, c),
    }
}

/// `a += f * b`, element-wise.
#[inline(always)]
fn axpy(a: &mut [f32], f: f32, b: &[f32]) {
    for (a, b) in a.iter_mut().zip(b) {
        *a += f * b;
    }
}

/// Two passes over `S` per position (it is read from cache, not registers: 64 KB for a 128 x 128
/// head): the decay fused with `S^T k`, the update fused with `S^T q`. Each row's operations
/// and each sum's order are those of the rule as written (decay all, then `S^T k`, ...).
#[inline(always)]
fn recurrent(x: &HeadInputs, s: &mut [f32], out: &mut [f32]) {
    let hv = x.v.width;
    let mut delta = vec![0.0f32; hv];
    for t in 0..x.len {
        let (q, k, v, g) = (x.q.at(t), x.k.at(t), x.v.at(t), x.g.at(t));
        delta.copy_from_slice(v);
        let per_head = match g {
            [g] => Some(g.exp()),
            _ => None,
        };
        for (c, (ki, srow)) in k.iter().zip(s.chunks_exact_mut(hv)).enumerate() {
            // Row `c` of S (key channel c) decays by exp(g), its own exp(g[c]) for KDA.
            let e = per_head.unwrap_or_else(|| g[c].exp());
            for (dv, sv) in delta.iter_mut().zip(srow.iter_mut()) {
                *sv *= e;
                *dv -= ki * *sv;
            }
        }
        let bt = x.beta.at(t)[0];
        delta.iter_mut().for_each(|x| *x *= bt);
        let o = &mut out[t * hv..(t + 1) * hv];
        o.fill(0.0);
        for ((ki, qi), srow) in k.iter().zip(q).zip(s.chunks_exact_mut(hv)) {
            for ((ov, sv), dv) in o.iter_mut().zip(srow.iter_mut()).zip(&delta) {
                *sv += ki * dv;
                *ov += qi * *sv;
            }
        }
    }
}

/// The decayed product `sum_c a[c] b[c] exp(gi[c] - gj[c])` of positions `i >= j` of a chunk
/// (`gi`, `gj` their cumulative log decays; one value each for a per-head decay).
#[inline(always)]
fn decayed_dot(a: &[f32], b: &[f32], gi: &[f32], gj: &[f32]) -> f32 {
    if let ([gi], [gj]) = (gi, gj) {
        let dot: f32 = a.iter().zip(b).map(|(a, b)| a * b).sum();
        dot * (gi - gj).exp()
    } else {
        a.iter()
            .zip(b)
            .zip(gi.iter().zip(gj))
            .map(|((a, b), (gi, gj))| a * b * (gi - gj).exp())
            .sum()
    }
}

#[inline(always)]
fn chunked(x: &HeadInputs, s: &mut [f32], out: &mut [f32], c: usize) {
    let (hk, hv, dw) = (x.k.width, x.v.width, x.g.width);
    let mut gcum = vec![0.0f32; c * dw];
    let mut a = vec![0.0f32; c * c];
    let mut old = vec![0.0f32; c];
    let mut u = vec![0.0f32; c * hv];
    let mut w = vec![0.0f32; c * hk];
    let mut vb = vec![0.0f32; c * hv];
    let mut kb = vec![0.0f32; c * hk];
    let mut qe = vec![0.0f32; hk];
    let mut t0 = 0;
    while t0 < x.len {
        let l = c.min(x.len - t0);
        // Cumulative log decay within the chunk (each entry <= the one before: decays <= 1).
        for t in 0..l {
            let (done, rest) = gcum.split_at_mut(t * dw);
            let row = &mut rest[..dw];
            row.copy_from_slice(x.g.at(t0 + t));
            if t > 0 {
                for (r, p) in row.iter_mut().zip(&done[(t - 1) * dw..]) {
                    *r += p;
                }
            }
        }
        let g = |t: usize| &gcum[t * dw..(t + 1) * dw];
        // A[i][j] = -beta_i (k_i . k_j, decayed from j to i) below the diagonal, then the
        // forward substitution that makes T = (I - A)^-1 - I as transformers' loop does (row i
        // from its own values before the step and the rows above after theirs).
        for i in 0..l {
            let (ki, bi) = (x.k.at(t0 + i), x.beta.at(t0 + i)[0]);
            for j in 0..i {
                a[i * c + j] = -bi * decayed_dot(ki, x.k.at(t0 + j), g(i), g(j));
            }
        }
        for i in 1..l {
            old[..i].copy_from_slice(&a[i * c..i * c + i]);
            for j in 0..i {
                let mut acc = old[j];
                for m in j + 1..i {
                    acc += old[m] * a[m * c + j];
                }
                a[i * c + j] = acc;
            }
        }
        // U = (T + I) (beta v), W = (T + I) (beta k exp(G)).
        for t in 0..l {
            let bt = x.beta.at(t0 + t)[0];
            for (o, v) in vb[t * hv..(t + 1) * hv].iter_mut().zip(x.v.at(t0 + t)) {
                *o = bt * v;
            }
            let kr = &mut kb[t * hk..(t + 1) * hk];
            for (ci, (o, k)) in kr.iter_mut().zip(x.k.at(t0 + t)).enumerate() {
                *o = bt * k * g(t)[ci % dw].exp();
            }
        }
        for i in 0..l {
            u[i * hv..(i + 1) * hv].copy_from_slice(&vb[i * hv..(i + 1) * hv]);
            w[i * hk..(i + 1) * hk].copy_from_slice(&kb[i * hk..(i + 1) * hk]);
            for j in 0..i {
                let f = a[i * c + j];
                let (ui, vj) = (i * hv, j * hv);
                for (o, v) in u[ui..ui + hv].iter_mut().zip(&vb[vj..vj + hv]) {
                    *o += f * v;
                }
                let (wi, kj) = (i * hk, j * hk);
                for (o, k) in w[wi..wi + hk].iter_mut().zip(&kb[kj..kj + hk]) {
                    *o += f * k;
                }
            }
        }
        // The chunk's new values against the state it starts from: U - W S (in u).
        for (ci, srow) in s.chunks_exact(hv).enumerate() {
            for i in 0..l {
                let f = -w[i * hk + ci];
                axpy(&mut u[i * hv..(i + 1) * hv], f, srow);
            }
        }
        // Outputs: (q exp(G)) S plus the decayed products within the chunk, causally.
        for i in 0..l {
            let qi = x.q.at(t0 + i);
            for (ci, (o, q)) in qe.iter_mut().zip(qi).enumerate() {
                *o = q * g(i)[ci % dw].exp();
            }
            let o = &mut out[(t0 + i) * hv..(t0 + i + 1) * hv];
            o.fill(0.0);
            for (qv, srow) in qe.iter().zip(s.chunks_exact(hv)) {
                axpy(o, *qv, srow);
            }
            for j in 0..=i {
                let f = decayed_dot(qi, x.k.at(t0 + j), g(i), g(j));
                axpy(o, f, &u[j * hv..(j + 1) * hv]);
            }
        }
        // The state after the chunk: S exp(G_last) + sum_t (k_t exp(G_last - G_t)) u_t^T.
        let last = g(l - 1).to_vec();
        for (ci, srow) in s.chunks_exact_mut(hv).enumerate() {
            let gl = last[ci % dw];
            let e = gl.exp();
            srow.iter_mut().for_each(|x| *x *= e);
            for t in 0..l {
                let f = x.k.at(t0 + t)[ci] * (gl - g(t)[ci % dw]).exp();
                axpy(srow, f, &u[t * hv..(t + 1) * hv]);
            }
        }
        t0 += l;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn wave(i: usize, seed: usize) -> f32 {
        ((i * 7919 + seed * 104729) % 2000) as f32 / 1000.0 - 1.0
    }

    struct Case {
        len: usize,
        hk: usize,
        hv: usize,
        dw: usize,
        data: Vec<f32>,
        s0: Vec<f32>,
    }

    /// Row layout per position: q | k | v | g | beta, normalised as the layer gives them.
    fn case(len: usize, hk: usize, hv: usize, per_channel: bool, seed: usize) -> Case {
        let dw = if per_channel { hk } else { 1 };
        let width = 2 * hk + hv + dw + 1;
        let mut data: Vec<f32> = (0..len * width).map(|i| wave(i, seed)).collect();
        for row in data.chunks_exact_mut(width) {
            for (r, scale) in [(0..hk, 1.0 / (hk as f32).sqrt()), (hk..2 * hk, 1.0)] {
                let n = row[r.clone()].iter().map(|x| x * x).sum::<f32>().sqrt() + 1e-6;
                row[r].iter_mut().for_each(|x| *x *= scale / n);
            }
            // Log decays in [-2, 0) (some strong), beta in (0, 1).
            for x in &mut row[2 * hk + hv..2 * hk + hv + dw] {
                *x = -(*x + 1.0);
            }
            let b = &mut row[width - 1];
            *b = 0.5 + 0.49 * *b;
        }
        let s0 = (0..hk * hv).map(|i| 0.3 * wave(i, seed + 7)).collect();
        Case {
            len,
            hk,
            hv,
            dw,
            data,
            s0,
        }
    }

    fn inputs(c: &Case) -> HeadInputs<'_> {
        let width = 2 * c.hk + c.hv + c.dw + 1;
        let rows = |offset, w| Rows {
            data: &c.data,
            offset,
            stride: width,
            width: w,
        };
        HeadInputs {
            len: c.len,
            q: rows(0, c.hk),
            k: rows(c.hk, c.hk),
            v: rows(2 * c.hk, c.hv),
            g: rows(2 * c.hk + c.hv, c.dw),
            beta: rows(width - 1, 1),
        }
    }

    fn run_case(c: &Case, kernel: Kernel, form: Form) -> (Vec<f32>, Vec<f32>) {
        let mut s = c.s0.clone();
        let mut out = vec![f32::NAN; c.len * c.hv];
        run(kernel, form, &inputs(c), &mut s, &mut out);
        (out, s)
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn every_kernel_gives_the_portable_bits_in_both_forms() {
        for per_channel in [false, true] {
            let c = case(70, 16, 12, per_channel, 3);
            for form in [Form::Recurrent, Form::Chunked(16), Form::Chunked(64)] {
                let want = run_case(&c, Kernel::Portable, form);
                for k in Kernel::available() {
                    let got = run_case(&c, k, form);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got.0), bits(&want.0), "{k:?} {form:?}");
                    assert_eq!(bits(&got.1), bits(&want.1), "{k:?} {form:?}");
                }
            }
        }
    }

    #[test]
    fn the_chunked_form_gives_the_recurrent_outputs_and_state() {
        let mut worst = 0.0f32;
        for per_channel in [false, true] {
            for (len, chunk) in [(1, 64), (5, 4), (64, 64), (65, 64), (150, 32), (97, 16)] {
                for (hk, hv) in [(8, 8), (16, 12), (12, 20)] {
                    let c = case(len, hk, hv, per_channel, len + hk);
                    let (ro, rs) = run_case(&c, Kernel::best(), Form::Recurrent);
                    let (co, cs) = run_case(&c, Kernel::best(), Form::Chunked(chunk));
                    let scale = ro.iter().chain(&rs).fold(0.0f32, |m, x| m.max(x.abs()));
                    let d = max_diff(&ro, &co).max(max_diff(&rs, &cs)) / scale;
                    assert!(
                        d < 2e-5,
                        "len {len} chunk {chunk} {hk}x{hv} {per_channel}: {d}"
                    );
                    worst = worst.max(d);
                }
            }
        }
        eprintln!("chunked vs recurrent: max relative difference {worst:.2e}");
    }

    #[test]
    fn a_run_split_anywhere_continues_as_one() {
        // The state carries a step's end to the next step, in either form.
        let c = case(90, 16, 12, true, 11);
        let (whole, s_whole) = run_case(&c, Kernel::best(), Form::Recurrent);
        for split in [1, 37, 64, 89] {
            let x = inputs(&c);
            let mut s = c.s0.clone();
            let mut out = vec![0.0; c.len * c.hv];
            let (a, b) = out.split_at_mut(split * c.hv);
            let first = HeadInputs { len: split, ..x };
            run(Kernel::best(), Form::Chunked(16), &first, &mut s, a);
            fn shift(r: Rows<'_>, by: usize) -> Rows<'_> {
                Rows {
                    offset: r.offset + by * r.stride,
                    ..r
                }
            }
            let second = HeadInputs {
                len: c.len - split,
                q: shift(x.q, split),
                k: shift(x.k, split),
                v: shift(x.v, split),
                g: shift(x.g, split),
                beta: shift(x.beta, split),
            };
            run(Kernel::best(), Form::Recurrent, &second, &mut s, b);
            assert!(max_diff(&out, &whole) < 1e-5, "split {split}");
            assert!(max_diff(&s, &s_whole) < 1e-5, "split {split}");
        }
    }
}

/// Measures the forms on one head of Qwen3-Next's and Kimi Linear's shapes (128 x 128); run by
/// hand: `cargo test --release -p colibri-engine --lib delta_rule::speed -- --ignored --nocapture`.
#[cfg(test)]
mod speed {
    use super::*;

    #[test]
    #[ignore]
    fn forms_per_position() {
        let (hk, hv) = (128, 128);
        for per_channel in [false, true] {
            for len in [1usize, 16, 64, 512] {
                let dw = if per_channel { hk } else { 1 };
                let width = 2 * hk + hv + dw + 1;
                let data: Vec<f32> = (0..len * width)
                    .map(|i| {
                        let c = i % width;
                        let x = ((i * 7919) % 2000) as f32 / 1000.0 - 1.0;
                        if c >= 2 * hk + hv {
                            -0.05 * (x + 1.0)
                        } else {
                            0.09 * x
                        }
                    })
                    .collect();
                let rows = |offset, w| Rows {
                    data: &data,
                    offset,
                    stride: width,
                    width: w,
                };
                let x = HeadInputs {
                    len,
                    q: rows(0, hk),
                    k: rows(hk, hk),
                    v: rows(2 * hk, hv),
                    g: rows(2 * hk + hv, dw),
                    beta: rows(width - 1, 1),
                };
                let mut line = format!("per_channel={per_channel} len={len:4} (us/position):");
                let mut runs: Vec<(Kernel, Form)> = Kernel::available()
                    .into_iter()
                    .map(|k| (k, Form::Recurrent))
                    .collect();
                runs.push((Kernel::best(), Form::Chunked(32)));
                runs.push((Kernel::best(), Form::Chunked(64)));
                for (kernel, form) in runs {
                    let mut best = f64::MAX;
                    for _ in 0..5 {
                        let mut s = vec![0.0f32; hk * hv];
                        let mut out = vec![0.0f32; len * hv];
                        let reps = (2048 / len).max(1);
                        let t = std::time::Instant::now();
                        for _ in 0..reps {
                            run(kernel, form, &x, &mut s, &mut out);
                        }
                        let per = t.elapsed().as_secs_f64() / (reps * len) as f64;
                        best = best.min(per);
                    }
                    line += &format!("  {kernel:?}/{form:?} {:.2}", best * 1e6);
                }
                eprintln!("{line}");
            }
        }
    }
}
