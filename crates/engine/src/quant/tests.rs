//! Kernel tests: every available path against the scalar oracle.

use super::*;
use crate::linear::WeightRef;
use crate::testutil::gauss;

fn available() -> Vec<Kernel> {
    Kernel::ALL.into_iter().filter(|k| k.available()).collect()
}

/// max |a - b| / max |b|.
fn rel_max_diff(a: &[f32], b: &[f32]) -> f64 {
    let scale = b
        .iter()
        .fold(0.0f64, |m, &v| m.max(v.abs() as f64))
        .max(1e-30);
    let d = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
    d / scale
}

const SHAPES: &[(usize, usize)] = &[
    (1, 32),
    (1, 72),
    (3, 40),
    (17, 200),
    (5, 256),
    (9, 288),
    (4, 1000),
    (6, 1024),
    (3, 544),
    (7, 1408),
    (33, 128),
];
const NS: &[usize] = &[1, 3, 5, 8];

/// Every grid, shape and token count of the kernel tests.
fn every_case() -> impl Iterator<Item = (Grid, &'static (usize, usize), &'static usize)> {
    GRIDS.into_iter().flat_map(|g| {
        SHAPES
            .iter()
            .flat_map(move |s| NS.iter().map(move |n| (g, s, n)))
    })
}

struct Case {
    rows: usize,
    cols: usize,
    grid: Grid,
    bytes: Vec<u8>,
    x: Vec<f32>,
}

impl Case {
    fn matrix(&self) -> Q4Matrix<'_> {
        Q4Matrix::on_grid(&self.bytes, self.rows, self.cols, self.grid).unwrap()
    }
}

/// Both grids: every int4 kernel path is tested on each.
const GRIDS: [Grid; 2] = [Grid::Linear, Grid::Table];

fn case(rows: usize, cols: usize, n: usize, seed: u64) -> Case {
    case_on(Grid::Linear, rows, cols, n, seed)
}

/// A random matrix quantized on `grid` and `n` activation vectors.
fn case_on(grid: Grid, rows: usize, cols: usize, n: usize, seed: u64) -> Case {
    let w = gauss(rows * cols, seed);
    let mut x = gauss(n * cols, seed + 1);
    // Some structure: a positive bias in part of the activations (like post-SiLU values).
    for (i, v) in x.iter_mut().enumerate() {
        if i % 3 == 0 {
            *v = v.abs() + 0.5;
        }
    }
    let bytes = match grid {
        Grid::Linear => quantize_q4(&w, rows, cols),
        Grid::Table => quantize_q4_table(&w, rows, cols, None),
    };
    Case {
        rows,
        cols,
        grid,
        bytes,
        x,
    }
}

#[test]
fn scalar_q4_matches_dequantized_dot() {
    for (grid, &(rows, cols), &n) in every_case() {
        {
            let c = case_on(grid, rows, cols, n, (rows * 31 + cols * 7 + n) as u64);
            let w = c.matrix();
            let mut a = Q8Acts::new();
            a.quantize(&c.x, n, cols);
            let mut out = vec![0.0; n * rows];
            q4_matmul(Kernel::Scalar, &w, &a, &mut out, rows, 0..rows);
            let wd = w.dequantize();
            for t in 0..n {
                let xd = a.dequantize(t);
                for r in 0..rows {
                    let exact: f64 = wd[r * cols..(r + 1) * cols]
                        .iter()
                        .zip(&xd)
                        .map(|(&p, &q)| p as f64 * q as f64)
                        .sum();
                    let mag: f64 = wd[r * cols..(r + 1) * cols]
                        .iter()
                        .zip(&xd)
                        .map(|(&p, &q)| (p as f64 * q as f64).abs())
                        .sum();
                    let got = out[t * rows + r] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * mag + 1e-12,
                        "{grid:?} {rows}x{cols} n={n} t={t} r={r}: {got} vs {exact}"
                    );
                }
            }
        }
    }
}

#[test]
fn simd_q4_matches_scalar_awkward_shapes_and_subranges() {
    let ks = available();
    println!("kernels available: {:?}", ks);
    let mut a = Q8Acts::new();
    for (grid, &(rows, cols), &n) in every_case() {
        {
            let c = case_on(grid, rows, cols, n, (rows * 131 + cols * 17 + n) as u64);
            let w = c.matrix();
            a.quantize(&c.x, n, cols);
            let stride = rows + 3;
            let mut want = vec![f32::NAN; n * stride];
            q4_matmul(Kernel::Scalar, &w, &a, &mut want, stride, 0..rows);
            let ranges = [
                0..rows,
                rows / 3..rows,
                0..rows / 2 + 1,
                rows / 2..rows / 2 + 1,
            ];
            for &k in &ks {
                for range in ranges.clone() {
                    let mut got = vec![f32::NAN; n * stride];
                    q4_matmul(k, &w, &a, &mut got, stride, range.clone());
                    for t in 0..n {
                        for r in 0..stride {
                            let g = got[t * stride + r];
                            if range.contains(&r) {
                                assert!(g.is_finite());
                            } else {
                                assert!(g.is_nan(), "{} wrote outside rows {range:?}", k.name());
                            }
                        }
                    }
                    let sel = |v: &[f32]| -> Vec<f32> {
                        (0..n)
                            .flat_map(|t| range.clone().map(move |r| (t, r)))
                            .map(|(t, r)| v[t * stride + r])
                            .collect()
                    };
                    let d = rel_max_diff(&sel(&got), &sel(&want));
                    assert!(
                        d < 1e-5,
                        "{} {grid:?} {rows}x{cols} n={n} rows {range:?}: rel diff {d}",
                        k.name()
                    );
                }
            }
        }
    }
}

#[test]
fn forced_kernels_via_public_api_and_variants() {
    let (rows, cols, n) = (37, 200, 6);
    let c = case(rows, cols, n, 99);
    let w = Q4Matrix::new(&c.bytes, rows, cols).unwrap();
    let mut a = Q8Acts::new();
    a.quantize(&c.x, n, cols);
    let mut want = vec![0.0; n * rows];
    q4_matmul(Kernel::Scalar, &w, &a, &mut want, rows, 0..rows);
    for k in Kernel::ALL {
        let (resolved, warn) = resolve_kernel(Some(k.name()));
        if !k.available() {
            assert!(warn.is_some());
            assert_eq!(resolved, Kernel::best());
            continue;
        }
        assert_eq!((resolved, warn), (k, None));
        // Whole output.
        let mut o1 = vec![0.0; n * rows];
        q4_matmul(resolved, &w, &a, &mut o1, rows, 0..rows);
        assert!(rel_max_diff(&o1, &want) < 1e-5, "{}", k.name());
        // Row-range-relative output.
        let (lo, hi) = (5, 30);
        let mut o2 = vec![0.0; n * (hi - lo)];
        q4_matmul_rows(resolved, &w, &a, &mut o2, hi - lo, lo..hi);
        for t in 0..n {
            for r in lo..hi {
                assert_eq!(o2[t * (hi - lo) + r - lo], o1[t * rows + r]);
            }
        }
        // OutView split across rayon tasks.
        let mut o3 = vec![0.0; n * rows];
        {
            use rayon::prelude::*;
            let view = OutView::new(&mut o3, n, rows, rows);
            view.chunks(8)
                .into_par_iter()
                .for_each(|v| q4_matmul_into(resolved, &w, &a, v));
        }
        assert_eq!(o3, o1);
        let mut o4 = vec![0.0; n * rows];
        q4_matmul_par(resolved, &w, &a, &mut o4, rows);
        assert_eq!(o4, o1);
    }
    assert_eq!(resolve_kernel(None).0, Kernel::best());
    assert!(resolve_kernel(Some("nonsense")).1.is_some());
    assert!(kernel().available());
}

#[test]
fn out_view_splits() {
    let mut buf = vec![0.0f32; 3 * 10];
    let v = OutView::new(&mut buf, 3, 10, 7);
    let (a, b) = v.split_at(3);
    assert_eq!((a.rows(), b.rows()), (0..3, 3..7));
    let parts = b.chunks(3);
    assert_eq!(
        parts.iter().map(|p| p.rows()).collect::<Vec<_>>(),
        vec![3..6, 6..7]
    );
    assert_eq!(a.n(), 3);
    assert_eq!(a.stride(), 10);
    assert_eq!(a.get(2, 1), 0.0);
}

#[test]
fn q4_matmul_n_zero_and_empty_rows() {
    let c = case(4, 64, 1, 5);
    let w = Q4Matrix::new(&c.bytes, 4, 64).unwrap();
    let mut a = Q8Acts::new();
    a.quantize(&[], 0, 64);
    for k in available() {
        q4_matmul(k, &w, &a, &mut [], 4, 0..4);
    }
    a.quantize(&c.x, 1, 64);
    for k in available() {
        let mut o = [7.0f32; 4];
        q4_matmul(k, &w, &a, &mut o, 4, 2..2);
        assert_eq!(o, [7.0; 4]);
    }
}

#[test]
fn prefill_larger_n_matches_scalar() {
    // Enough tokens to span several token blocks of the SIMD kernels, and (500 rows of 2080
    // columns) several row chunks with a ragged last one, over the whole range and a sub-range
    // starting off the tile grid.
    let (rows, cols, n) = (500, 2080, 70);
    let c = case(rows, cols, n, 4242);
    let w = Q4Matrix::new(&c.bytes, rows, cols).unwrap();
    let mut a = Q8Acts::new();
    a.quantize(&c.x, n, cols);
    let mut want = vec![0.0; n * rows];
    q4_matmul(Kernel::Scalar, &w, &a, &mut want, rows, 0..rows);
    for k in available() {
        for range in [0..rows, 7..rows] {
            let mut got = want.clone();
            for t in 0..n {
                got[t * rows + range.start..(t + 1) * rows].fill(f32::NAN);
            }
            q4_matmul(k, &w, &a, &mut got, rows, range.clone());
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{} left outputs unwritten",
                k.name()
            );
            assert!(rel_max_diff(&got, &want) < 1e-5, "{} {range:?}", k.name());
        }
    }
}

#[test]
fn f32_matmul_all_paths_accurate() {
    for &(rows, cols) in &[(1, 1), (3, 7), (5, 40), (17, 72), (9, 200), (6, 1031)] {
        for &n in &[1usize, 2, 3, 5, 8] {
            let w = gauss(rows * cols, (rows * 7 + cols) as u64);
            let x = gauss(n * cols, (n * 13 + cols) as u64);
            let stride = rows + 1;
            let mut exact = vec![0.0f32; n * stride];
            let mut mag = vec![0.0f64; n * stride];
            for t in 0..n {
                for r in 0..rows {
                    let (mut s, mut m) = (0.0f64, 0.0f64);
                    for k in 0..cols {
                        let p = w[r * cols + k] as f64 * x[t * cols + k] as f64;
                        s += p;
                        m += p.abs();
                    }
                    exact[t * stride + r] = s as f32;
                    mag[t * stride + r] = m;
                }
            }
            for k in available() {
                for range in [0..rows, rows / 2..rows] {
                    let mut got = vec![f32::NAN; n * stride];
                    f32_matmul(k, &w, cols, &x, n, &mut got, stride, range.clone());
                    for t in 0..n {
                        for r in 0..stride {
                            let g = got[t * stride + r];
                            if range.contains(&r) {
                                let e = (g as f64 - exact[t * stride + r] as f64).abs();
                                assert!(
                                    e <= 1e-6 * mag[t * stride + r] + 1e-30,
                                    "{} {rows}x{cols} n={n}: {g} vs {}",
                                    k.name(),
                                    exact[t * stride + r]
                                );
                            } else {
                                assert!(g.is_nan());
                            }
                        }
                    }
                    let mut rel = vec![0.0; n * range.len()];
                    f32_matmul_rows(k, &w, cols, &x, n, &mut rel, range.len(), range.clone());
                    for t in 0..n {
                        for r in range.clone() {
                            assert_eq!(rel[t * range.len() + r - range.start], got[t * stride + r]);
                        }
                    }
                }
                let mut par = vec![0.0; n * rows];
                f32_matmul_par(k, &w, rows, cols, &x, n, &mut par, rows);
                let mut seq = vec![0.0; n * rows];
                f32_matmul(k, &w, cols, &x, n, &mut seq, rows, 0..rows);
                assert_eq!(par, seq);
            }
        }
    }
}

#[test]
#[should_panic(expected = "too short")]
fn q4_matmul_checks_output_length() {
    let c = case(4, 64, 2, 5);
    let w = Q4Matrix::new(&c.bytes, 4, 64).unwrap();
    let mut a = Q8Acts::new();
    a.quantize(&c.x, 2, 64);
    let mut o = vec![0.0; 7];
    q4_matmul(Kernel::Scalar, &w, &a, &mut o, 4, 0..4);
}

#[test]
fn decode_path_equals_batched_tiles_bit_for_bit() {
    // One token goes through its own row loop (AVX-512 and AVX2: `q4_decode_rows` when the
    // groups fill whole blocks of 16); the same vector repeated in a batch goes through the multi-row,
    // multi-token tiles. Both compute the same exact integer per group and do the same float
    // arithmetic in the same order per output.
    for &(rows, cols) in &[
        (37usize, 256usize),
        (64, 2048),
        (5, 1024),
        (9, 288),
        (6, 1408),
        (3, 544),
        // Rows shorter than a block: of 4 groups (MLA's per-head W_uk^T), four at a time in the
        // AVX-512 decode with rows left over, and of 1-8 groups; and one block and a half.
        (40, 128),
        (7, 32),
        (35, 32),
        (19, 64),
        (23, 96),
        (21, 224),
        (9, 256),
        (11, 768),
    ] {
        for grid in GRIDS {
            let c = case_on(grid, rows, cols, 1, 77 + cols as u64);
            let w = c.matrix();
            let mut one = Q8Acts::new();
            one.quantize(&c.x, 1, cols);
            let n = 5;
            let xs: Vec<f32> = (0..n).flat_map(|_| c.x.iter().copied()).collect();
            let mut many = Q8Acts::new();
            many.quantize(&xs, n, cols);
            for k in available() {
                for range in [0..rows, 3..rows] {
                    let mut got1 = vec![0.0; rows];
                    q4_matmul(k, &w, &one, &mut got1, rows, range.clone());
                    let mut gotn = vec![0.0; n * rows];
                    q4_matmul(k, &w, &many, &mut gotn, rows, range.clone());
                    for t in 0..n {
                        let batched = &gotn[t * rows..(t + 1) * rows];
                        assert_eq!(
                            got1[range.clone()]
                                .iter()
                                .map(|v| v.to_bits())
                                .collect::<Vec<_>>(),
                            batched[range.clone()]
                                .iter()
                                .map(|v| v.to_bits())
                                .collect::<Vec<_>>(),
                            "{} {grid:?} {rows}x{cols} {range:?} token {t}",
                            k.name()
                        );
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_kernel_with_avx_vnni_gives_the_same_bits() {
    if !(Kernel::Avx2.available() && std::arch::is_x86_feature_detected!("avxvnni")) {
        println!("no AVX2 + AVX-VNNI here: nothing to compare");
        return;
    }
    let mut a = Q8Acts::new();
    for (grid, &(rows, cols), &n) in every_case() {
        {
            let c = case_on(grid, rows, cols, n, (rows * 7 + cols * 3 + n) as u64);
            let w = c.matrix();
            a.quantize(&c.x, n, cols);
            let run = |vnni: bool| {
                let mut out = vec![f32::NAN; n * rows];
                // SAFETY: AVX2/FMA/F16C (available) and AVX-VNNI (detected) are present; the
                // rows are w's, the activations have its width, `out` holds n * rows values.
                unsafe {
                    super::x86_avx2::q4_rows_with(vnni, &w, &a, out.as_mut_ptr(), rows, 0..rows)
                };
                out.into_iter().map(f32::to_bits).collect::<Vec<_>>()
            };
            assert_eq!(run(true), run(false), "{grid:?} {rows}x{cols} n={n}");
        }
    }
}

#[test]
fn every_prefetch_level_gives_the_same_bits() {
    // The prefetch is a hint: with it into L1, into L2 or off (whose stream cursor starts out of
    // reach), every kernel computes the same outputs, one token (the decode row loops) or many
    // (the tiles). The level is process-wide, so another test may switch it meanwhile; that can
    // only make two runs share a level, never make their bits differ.
    use super::prefetch::{prefetch_level, set_prefetch_level, PrefetchLevel};
    let before = prefetch_level();
    let mut a = Q8Acts::new();
    for &(rows, cols) in &[(64usize, 2048usize), (9, 288), (7, 1408), (3, 40)] {
        for (grid, &n) in GRIDS.iter().flat_map(|&g| [(g, &1usize), (g, &5)]) {
            let c = case_on(grid, rows, cols, n, (rows * 5 + cols + n) as u64);
            let w = c.matrix();
            a.quantize(&c.x, n, cols);
            for k in available() {
                let run = |level: PrefetchLevel| {
                    set_prefetch_level(level);
                    let mut out = vec![f32::NAN; n * rows];
                    q4_matmul(k, &w, &a, &mut out, rows, 0..rows);
                    out.into_iter().map(f32::to_bits).collect::<Vec<_>>()
                };
                let want = run(PrefetchLevel::L2);
                for level in [PrefetchLevel::L1, PrefetchLevel::Off] {
                    assert_eq!(
                        run(level),
                        want,
                        "{} {grid:?} {rows}x{cols} n={n} {}",
                        k.name(),
                        level.name()
                    );
                }
            }
        }
    }
    set_prefetch_level(before);
}

// --- 8-bit weights ---------------------------------------------------------------------------

/// Shapes for the 8-bit kernels: partial last groups (cols not a multiple of 32), partial last
/// blocks (groups not a multiple of 16: 1, 3, 7, 9, 17, 34, 44 groups), rows shorter than a
/// block, odd row counts.
const Q8_SHAPES: &[(usize, usize)] = &[
    (1, 32),
    (1, 72),
    (3, 40),
    (17, 200),
    (5, 256),
    (9, 288),
    (4, 1000),
    (6, 1024),
    (3, 544),
    (7, 1408),
    (11, 128),
    (13, 1090),
];

fn q8_case(rows: usize, cols: usize, n: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let c = case(rows, cols, n, seed);
    let w = gauss(rows * cols, seed);
    (quantize_q8(&w, rows, cols), c.x)
}

#[test]
fn scalar_q8_matches_dequantized_dot() {
    for &(rows, cols) in Q8_SHAPES {
        for &n in NS {
            let (bytes, x) = q8_case(rows, cols, n, (rows * 31 + cols * 7 + n) as u64);
            let w = Q8Matrix::new(&bytes, rows, cols).unwrap();
            let mut a = Q8Acts::new();
            a.quantize(&x, n, cols);
            let mut out = vec![0.0; n * rows];
            q8_matmul(Kernel::Scalar, &w, &a, &mut out, rows, 0..rows);
            let wd = w.dequantize();
            for t in 0..n {
                let xd = a.dequantize(t);
                for r in 0..rows {
                    let row = &wd[r * cols..(r + 1) * cols];
                    let exact: f64 = row
                        .iter()
                        .zip(&xd)
                        .map(|(&p, &q)| p as f64 * q as f64)
                        .sum();
                    let mag: f64 = row
                        .iter()
                        .zip(&xd)
                        .map(|(&p, &q)| (p as f64 * q as f64).abs())
                        .sum();
                    let got = out[t * rows + r] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * mag + 1e-12,
                        "{rows}x{cols} n={n} t={t} r={r}: {got} vs {exact}"
                    );
                }
            }
        }
    }
}

#[test]
fn simd_q8_matches_scalar_awkward_shapes_and_subranges() {
    let mut a = Q8Acts::new();
    for &(rows, cols) in Q8_SHAPES {
        for &n in NS {
            let (bytes, x) = q8_case(rows, cols, n, (rows * 131 + cols * 17 + n) as u64);
            let w = Q8Matrix::new(&bytes, rows, cols).unwrap();
            a.quantize(&x, n, cols);
            let stride = rows + 3;
            let mut want = vec![f32::NAN; n * stride];
            q8_matmul(Kernel::Scalar, &w, &a, &mut want, stride, 0..rows);
            for k in available() {
                for range in [
                    0..rows,
                    rows / 3..rows,
                    0..rows / 2 + 1,
                    rows / 2..rows / 2 + 1,
                ] {
                    let mut got = vec![f32::NAN; n * stride];
                    q8_matmul(k, &w, &a, &mut got, stride, range.clone());
                    for t in 0..n {
                        for r in 0..stride {
                            let g = got[t * stride + r];
                            if range.contains(&r) {
                                assert!(g.is_finite());
                            } else {
                                assert!(g.is_nan(), "{} wrote outside rows {range:?}", k.name());
                            }
                        }
                    }
                    let sel = |v: &[f32]| -> Vec<f32> {
                        (0..n)
                            .flat_map(|t| range.clone().map(move |r| (t, r)))
                            .map(|(t, r)| v[t * stride + r])
                            .collect()
                    };
                    let d = rel_max_diff(&sel(&got), &sel(&want));
                    assert!(
                        d < 1e-5,
                        "{} {rows}x{cols} n={n} rows {range:?}: rel diff {d}",
                        k.name()
                    );
                }
            }
        }
    }
}

#[test]
fn q4_extreme_values_do_not_overflow() {
    // Rows written directly: scales 1, values 0, 1 of each dword nibble 15 (+7) and 2, 3 nibble
    // 1 (-7) (every stored nibble byte `p` holds two values with `j % 4 == p % 4`), so each i16
    // lane of AVX2's maddubs holds two nibble-15 products: with activations all +-127, the
    // largest pairs the unsigned nibbles can make (+-2 * 15 * 127), their i16 sum over a half
    // block's four dwords, low and high nibbles, the largest too (+-8 * 15 * 127 = +-30480, the
    // AVX2 kernel's i16 accumulator at its fullest), and the i32 group sums the largest. Every kernel gives the scalar bits, on whole blocks, a partial block,
    // one token (decode) and several (tiles).
    let (rows, cols) = (5, 16 * 32 + 96);
    let groups = cols / 32;
    let row: Vec<u8> = (0..groups)
        .flat_map(|_| half::f16::from_f32(1.0).to_le_bytes())
        .chain((0..groups * 16).map(|p| if p % 4 < 2 { 0xff } else { 0x11 }))
        .collect();
    let bytes = row.repeat(rows);
    let m = Q4Matrix::new(&bytes, rows, cols).unwrap();
    let w: Vec<f32> = (0..cols)
        .map(|c| if c % 4 < 2 { 7.0 } else { -7.0 })
        .collect();
    let mut deq = vec![0.0; cols];
    m.dequantize_row(0, &mut deq);
    assert_eq!(deq, w);
    let x: Vec<f32> = (0..3 * cols)
        .map(|i| if i / cols == 1 { -2.0 } else { 2.0 })
        .collect();
    let mut a = Q8Acts::new();
    for n in [1, 2, 3] {
        a.quantize(&x[..n * cols], n, cols);
        let mut want = vec![0.0; n * rows];
        q4_matmul(Kernel::Scalar, &m, &a, &mut want, rows, 0..rows);
        for t in 0..n {
            // Half the products +14, half -14: the sum is 0.
            let exact: f32 = (0..cols).map(|c| w[c] * x[t * cols + c]).sum();
            assert!(
                (want[t * rows] - exact).abs() <= 1e-3,
                "{} vs {exact}",
                want[t * rows]
            );
        }
        for k in available() {
            let mut got = vec![0.0; n * rows];
            q4_matmul(k, &m, &a, &mut got, rows, 0..rows);
            assert_eq!(got, want, "{} n={n}", k.name());
        }
    }
}

#[test]
fn table_grid_extreme_values_do_not_overflow() {
    // The table grid's largest unsigned value (code 15: level 15 + 16 = 31) in every nibble,
    // against activations all +-127: AVX2's maddubs pairs are then 2 * 31 * 127 = 7874, the
    // most its i16 lanes add (four, two dwords of low and high nibbles) 31496; one row of code 0
    // (level -16, unsigned 0) beside them. Every kernel gives the scalar bits, whole blocks
    // and a partial one, one token and several.
    let (rows, cols) = (4, 16 * 32 + 96);
    let groups = cols / 32;
    let row = |byte: u8| -> Vec<u8> {
        (0..groups)
            .flat_map(|_| half::f16::from_f32(1.0).to_le_bytes())
            .chain((0..groups * 16).map(|_| byte))
            .collect()
    };
    let bytes = [row(0xff), row(0x00), row(0xff), row(0x0f)].concat();
    let m = Q4Matrix::on_grid(&bytes, rows, cols, Grid::Table).unwrap();
    let mut deq = vec![0.0; cols];
    m.dequantize_row(1, &mut deq);
    assert!(deq.iter().all(|&v| v == -16.0));
    let x: Vec<f32> = (0..3 * cols)
        .map(|i| if i / cols == 1 { -2.0 } else { 2.0 })
        .collect();
    let mut a = Q8Acts::new();
    for n in [1, 2, 3] {
        a.quantize(&x[..n * cols], n, cols);
        let mut want = vec![0.0; n * rows];
        q4_matmul(Kernel::Scalar, &m, &a, &mut want, rows, 0..rows);
        for t in 0..n {
            let sign = if t == 1 { -1.0 } else { 1.0 };
            let expect = [15.0, -16.0, 15.0, -0.5];
            for (r, e) in expect.iter().enumerate() {
                let exact = e * 2.0 * sign * cols as f32;
                assert!(
                    (want[t * rows + r] - exact).abs() <= 1e-3 * exact.abs(),
                    "row {r}: {} vs {exact}",
                    want[t * rows + r]
                );
            }
        }
        for k in available() {
            let mut got = vec![0.0; n * rows];
            q4_matmul(k, &m, &a, &mut got, rows, 0..rows);
            assert_eq!(got, want, "{} n={n}", k.name());
        }
    }
}

#[test]
fn q8_extreme_values_do_not_saturate() {
    // Every weight and activation at ±127 (the extremes of both ranges), in sign patterns that
    // make each i16 pair of AVX2's maddubs as large as it gets (2 * 127 * 127) and each group's
    // sum ±32 * 127 * 127: every kernel gives exactly what the scalar integer gives.
    let (rows, cols) = (6, 16 * 32 + 40);
    for pattern in 0..4 {
        let sign = |i: usize, s: usize| -> f32 {
            match pattern {
                0 => 1.0,
                1 => 1.0 - 2.0 * ((i / s) % 2) as f32,
                2 => -1.0,
                _ => 1.0 - 2.0 * (i * 7 + s).is_multiple_of(3) as u8 as f32,
            }
        };
        let w: Vec<f32> = (0..rows * cols).map(|i| sign(i, 1) * 0.5).collect();
        let x: Vec<f32> = (0..2 * cols).map(|i| sign(i, 2) * 2.0).collect();
        let bytes = quantize_q8(&w, rows, cols);
        let m = Q8Matrix::new(&bytes, rows, cols).unwrap();
        let mut a = Q8Acts::new();
        for n in [1, 2] {
            a.quantize(&x[..n * cols], n, cols);
            let mut want = vec![0.0; n * rows];
            q8_matmul(Kernel::Scalar, &m, &a, &mut want, rows, 0..rows);
            // The exact value: every product is ±1 (0.5 * 2), summed over cols.
            for t in 0..n {
                for r in 0..rows {
                    let exact: f32 = (0..cols).map(|c| w[r * cols + c] * x[t * cols + c]).sum();
                    assert!((want[t * rows + r] - exact).abs() <= 1e-3 * cols as f32);
                }
            }
            for k in available() {
                let mut got = vec![0.0; n * rows];
                q8_matmul(k, &m, &a, &mut got, rows, 0..rows);
                assert!(
                    rel_max_diff(&got, &want) < 1e-6,
                    "{} pattern {pattern} n={n}",
                    k.name()
                );
            }
        }
    }
}

#[test]
fn q8_prefill_larger_n_matches_scalar() {
    // Several token blocks and row chunks (600 rows of 2080 columns at 34 bytes a group), a
    // ragged last chunk, and a sub-range starting off the tile grid.
    let (rows, cols, n) = (601, 2080, 70);
    let (bytes, x) = q8_case(rows, cols, n, 4243);
    let w = Q8Matrix::new(&bytes, rows, cols).unwrap();
    let mut a = Q8Acts::new();
    a.quantize(&x, n, cols);
    let mut want = vec![0.0; n * rows];
    q8_matmul(Kernel::Scalar, &w, &a, &mut want, rows, 0..rows);
    for k in available() {
        for range in [0..rows, 7..rows] {
            let mut got = want.clone();
            for t in 0..n {
                got[t * rows + range.start..(t + 1) * rows].fill(f32::NAN);
            }
            q8_matmul(k, &w, &a, &mut got, rows, range.clone());
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{} left outputs unwritten",
                k.name()
            );
            assert!(rel_max_diff(&got, &want) < 1e-5, "{} {range:?}", k.name());
        }
    }
}

#[test]
fn q8_decode_path_equals_batched_tiles_bit_for_bit() {
    // One token takes each SIMD kernel's own row loop (partial last blocks read in place with
    // masked loads); the same vector repeated in a batch takes the tiles (a zero-filled copy of
    // the partial block). Same exact integers, same float operations in the same order.
    for &(rows, cols) in &[
        (37usize, 256usize),
        (64, 2048),
        (5, 1024),
        (9, 288),
        (6, 1408),
        (3, 544),
        (40, 128),
        (7, 32),
        (11, 768),
        (13, 1090),
    ] {
        let (bytes, x) = q8_case(rows, cols, 1, 77 + cols as u64);
        let w = Q8Matrix::new(&bytes, rows, cols).unwrap();
        let mut one = Q8Acts::new();
        one.quantize(&x, 1, cols);
        let n = 5;
        let xs: Vec<f32> = (0..n).flat_map(|_| x.iter().copied()).collect();
        let mut many = Q8Acts::new();
        many.quantize(&xs, n, cols);
        for k in available() {
            for range in [0..rows, 3.min(rows - 1)..rows] {
                let mut got1 = vec![0.0; rows];
                q8_matmul(k, &w, &one, &mut got1, rows, range.clone());
                let mut gotn = vec![0.0; n * rows];
                q8_matmul(k, &w, &many, &mut gotn, rows, range.clone());
                for t in 0..n {
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got1[range.clone()]),
                        bits(&gotn[t * rows..(t + 1) * rows][range.clone()]),
                        "{} {rows}x{cols} {range:?} token {t}",
                        k.name()
                    );
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn q8_avx2_kernel_with_avx_vnni_gives_the_same_bits() {
    if !(Kernel::Avx2.available() && std::arch::is_x86_feature_detected!("avxvnni")) {
        println!("no AVX2 + AVX-VNNI here: nothing to compare");
        return;
    }
    let mut a = Q8Acts::new();
    for &(rows, cols) in Q8_SHAPES {
        for &n in NS {
            let (bytes, x) = q8_case(rows, cols, n, (rows * 7 + cols * 3 + n) as u64);
            let w = Q8Matrix::new(&bytes, rows, cols).unwrap();
            a.quantize(&x, n, cols);
            let run = |vnni: bool| {
                let mut out = vec![f32::NAN; n * rows];
                // SAFETY: AVX2/FMA/F16C (available) and AVX-VNNI (detected) are present; the
                // rows are w's, the activations have its width, `out` holds n * rows values.
                unsafe {
                    super::x86_avx2::q8_rows_with(vnni, &w, &a, out.as_mut_ptr(), rows, 0..rows)
                };
                out.into_iter().map(f32::to_bits).collect::<Vec<_>>()
            };
            assert_eq!(run(true), run(false), "{rows}x{cols} n={n}");
        }
    }
}

#[test]
fn q8_every_prefetch_level_gives_the_same_bits() {
    use super::prefetch::{prefetch_level, set_prefetch_level, PrefetchLevel};
    let before = prefetch_level();
    let mut a = Q8Acts::new();
    for &(rows, cols) in &[(64usize, 2048usize), (9, 288), (7, 1408), (3, 40)] {
        for &n in &[1usize, 5] {
            let (bytes, x) = q8_case(rows, cols, n, (rows * 5 + cols + n) as u64);
            let w = Q8Matrix::new(&bytes, rows, cols).unwrap();
            a.quantize(&x, n, cols);
            for k in available() {
                let run = |level: PrefetchLevel| {
                    set_prefetch_level(level);
                    let mut out = vec![f32::NAN; n * rows];
                    q8_matmul(k, &w, &a, &mut out, rows, 0..rows);
                    out.into_iter().map(f32::to_bits).collect::<Vec<_>>()
                };
                let want = run(PrefetchLevel::L2);
                for level in [PrefetchLevel::L1, PrefetchLevel::Off] {
                    assert_eq!(run(level), want, "{} {rows}x{cols} n={n}", k.name());
                }
            }
        }
    }
    set_prefetch_level(before);
}

#[test]
fn q8_weights_are_closer_than_int4_and_n_zero_is_a_no_op() {
    // The point of the format: on the same weights and activations the 8-bit product is much
    // closer to the exact f32 one than the int4 product.
    let (rows, cols, n) = (64, 1024, 3);
    let w = gauss(rows * cols, 5);
    let x = gauss(n * cols, 6);
    let mut a = Q8Acts::new();
    a.quantize(&x, n, cols);
    let exact: Vec<f32> = (0..n)
        .flat_map(|t| {
            let (w, x) = (&w, &x);
            (0..rows).map(move |r| {
                (0..cols)
                    .map(|c| w[r * cols + c] as f64 * x[t * cols + c] as f64)
                    .sum::<f64>() as f32
            })
        })
        .collect();
    let b8 = quantize_q8(&w, rows, cols);
    let b4 = quantize_q4(&w, rows, cols);
    let (m8, m4) = (
        Q8Matrix::new(&b8, rows, cols).unwrap(),
        Q4Matrix::new(&b4, rows, cols).unwrap(),
    );
    let (mut o8, mut o4) = (vec![0.0; n * rows], vec![0.0; n * rows]);
    q8_matmul(kernel(), &m8, &a, &mut o8, rows, 0..rows);
    q4_matmul(kernel(), &m4, &a, &mut o4, rows, 0..rows);
    let err = |o: &[f32]| {
        let num: f64 = o
            .iter()
            .zip(&exact)
            .map(|(&p, &q)| ((p - q) as f64).powi(2))
            .sum();
        let den: f64 = exact.iter().map(|&q| (q as f64).powi(2)).sum();
        (num / den).sqrt()
    };
    let (e8, e4) = (err(&o8), err(&o4));
    println!("relative error of the product: 8-bit {e8:.5}, int4 {e4:.5}");
    assert!(e8 < e4 / 3.0, "8-bit {e8} vs int4 {e4}");
    a.quantize(&[], 0, cols);
    for k in available() {
        q8_matmul(k, &m8, &a, &mut [], rows, 0..rows);
        let mut o = [7.0f32; 4];
        a.quantize(&x[..cols], 1, cols);
        q8_matmul(k, &m8, &a, &mut o, 4, 2..2);
        assert_eq!(o, [7.0; 4]);
        a.quantize(&[], 0, cols);
    }
}

/// The exact (f32-activation) products of int4 and 8-bit weights: every kernel gives the
/// dequantized matrix times the unrounded activations (to f32 rounding against an f64 sum),
/// on widths with a partial last block and padding; every kernel the same bits, and each
/// token the bits it gets alone (a prompt's passes may be cut anywhere).
#[test]
fn exact_products_are_the_dequantized_weights_times_f32_activations() {
    for (cols, rows) in [
        (32, 5),
        (64, 4),
        (128, 7),
        (192, 6),
        (200, 13),
        (256, 5),
        (320, 3),
        (512, 9),
        (608, 17),
        (1000, 3),
        (1088, 2),
    ] {
        let w = gauss(rows * cols, cols as u64);
        let q4 = quantize_q4(&w, rows, cols);
        let q8 = quantize_q8(&w, rows, cols);
        let m4 = Q4Matrix::new(&q4, rows, cols).unwrap();
        let m8 = Q8Matrix::new(&q8, rows, cols).unwrap();
        for n in [1, 3, 6] {
            let x = gauss(n * cols, 7 + n as u64);
            let stored = StoredActs::new(&x, n, cols);
            for (dq, what) in [(m4.dequantize(), "int4"), (m8.dequantize(), "8-bit")] {
                // The f64 reference and the size of its terms (the bound on f32 rounding).
                let mut want = vec![0.0f32; n * rows];
                let mut mag = vec![0.0f64; n * rows];
                for t in 0..n {
                    for r in 0..rows {
                        let (wr, xt) =
                            (&dq[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                        let terms = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64);
                        want[t * rows + r] = terms.clone().sum::<f64>() as f32;
                        mag[t * rows + r] = terms.map(f64::abs).sum();
                    }
                }
                let product = |k: Kernel, x: &StoredActs| {
                    let mut got = vec![0.0f32; x.n * rows];
                    let view = OutView::new(&mut got, x.n, rows, rows);
                    match what {
                        "int4" => q4_exact_into(k, &m4, x, view),
                        _ => q8_exact_into(k, &m8, x, view),
                    }
                    got
                };
                let scalar = product(Kernel::Scalar, &stored);
                for t in 0..n {
                    let alone = StoredActs::new(&x[t * cols..(t + 1) * cols], 1, cols);
                    let one = product(Kernel::Scalar, &alone);
                    assert!(
                        one == scalar[t * rows..(t + 1) * rows],
                        "{what} token {t} of {n}"
                    );
                }
                for k in available() {
                    let got = product(k, &stored);
                    assert!(
                        got == scalar,
                        "{what} {}: not the scalar path's bits",
                        k.name()
                    );
                    for i in 0..n * rows {
                        let err = (got[i] - want[i]).abs() as f64;
                        assert!(
                            err <= 1e-5 * mag[i] + 1e-30,
                            "{what} {} cols={cols} n={n} [{i}]: {} vs {}",
                            k.name(),
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

/// An exact product of a view's rows writes those rows only.
#[test]
fn an_exact_product_writes_only_its_views_rows() {
    let (rows, cols, n) = (40, 96, 2);
    let w = gauss(rows * cols, 3);
    let q4 = quantize_q4(&w, rows, cols);
    let m = Q4Matrix::new(&q4, rows, cols).unwrap();
    let stored = StoredActs::new(&gauss(n * cols, 4), n, cols);
    for k in available() {
        let mut whole = vec![0.0f32; n * rows];
        q4_exact_into(k, &m, &stored, OutView::new(&mut whole, n, rows, rows));
        let mut parts = vec![f32::NAN; n * rows];
        let (a, b) = OutView::new(&mut parts, n, rows, rows).split_at(11);
        q4_exact_into(k, &m, &stored, b);
        q4_exact_into(k, &m, &stored, a);
        assert_eq!(parts, whole, "{}", k.name());
    }
}

/// An int4 or 8-bit matrix read by columns ([`Columns`]) gives the dequantized matrix times
/// the unrounded activations (to f32 rounding against an f64 sum), on heights with a partial
/// tile and widths with a partial group; every kernel the scalar path's bits, and each token
/// the bits it gets alone.
#[test]
fn column_products_are_the_dequantized_weights_times_f32_activations() {
    for (rows, cols) in [
        (64, 32),
        (100, 40),
        (512, 128),
        (128, 512),
        (130, 200),
        (7, 64),
    ] {
        let w = gauss(rows * cols, (rows * 31 + cols) as u64);
        let (q4, q8) = (quantize_q4(&w, rows, cols), quantize_q8(&w, rows, cols));
        let formats = [
            WeightRef::Q4(Q4Matrix::new(&q4, rows, cols).unwrap()),
            WeightRef::Q8(Q8Matrix::new(&q8, rows, cols).unwrap()),
        ];
        for m in &formats {
            let what = format!(
                "{rows}x{cols} {}",
                if matches!(m, WeightRef::Q4(_)) {
                    "int4"
                } else {
                    "8-bit"
                }
            );
            let c = Columns::new(m).expect("a quantized matrix has columns");
            assert_eq!((c.rows(), c.cols()), (rows, cols));
            let q8 = matches!(m, WeightRef::Q8(_));
            assert_eq!(c.bytes(), Columns::bytes_of(rows, cols, q8), "{what}");
            let dq = match m {
                WeightRef::Q4(m) => m.dequantize(),
                WeightRef::Q8(m) => m.dequantize(),
                WeightRef::F32(_) => unreachable!(),
            };
            for n in [1, 3] {
                let x = gauss(n * cols, 11 + n as u64);
                let product = |k: Kernel, x: &[f32], n: usize| {
                    let mut out = vec![f32::NAN; n * rows];
                    columns_exact_into(k, &c, x, n, &mut out);
                    out
                };
                let scalar = product(Kernel::Scalar, &x, n);
                for t in 0..n {
                    let one = product(Kernel::Scalar, &x[t * cols..(t + 1) * cols], 1);
                    assert!(
                        one == scalar[t * rows..(t + 1) * rows],
                        "{what}: token {t} of {n}"
                    );
                }
                for k in available() {
                    let got = product(k, &x, n);
                    assert!(
                        got == scalar,
                        "{what} {}: not the scalar path's bits",
                        k.name()
                    );
                }
                for t in 0..n {
                    for r in 0..rows {
                        let terms =
                            (0..cols).map(|i| dq[r * cols + i] as f64 * x[t * cols + i] as f64);
                        let want = terms.clone().sum::<f64>();
                        let mag: f64 = terms.map(f64::abs).sum();
                        let got = scalar[t * rows + r] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * mag + 1e-30,
                            "{what} token {t} row {r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
    assert!(Columns::new(&WeightRef::F32(&[0.0; 4])).is_none());
}
