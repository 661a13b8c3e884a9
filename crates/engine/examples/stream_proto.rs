//! Prototype for decode-speed experiments (AVX-512 VNNI CPUs only): streams an OLMoE-shaped
//! decode step (16 layers of q/k/v, o, 8 experts' gate+up, 8 downs, then the LM head; ~0.66 GB)
//! through a stand-alone copy of the n = 1 int4 kernel on a [`Pool`], with variants of the
//! weight layout, the prefetching, the rows per tile and the split of rows across threads.
//! Several configurations run interleaved step by step, so machine drift hits them alike.
//!
//! `CONFIGS="layout,pf,hint,R,chunk,mode;..." cargo run --release --example stream_proto -- THREADS`
//! * layout: `split` (format v1: all nibbles, then all scales), `row` (per row: scales then
//!   nibbles, format v2 since this measurement), `sb` (per 256 weights: 8 f16 scales then 128 nibble bytes);
//! * pf: `cur` (2 nibble lines + 1 scale prefetch per 8 groups), `line` (scale prefetch once
//!   per line), `none`; hint: `t0`, `t1`, `nta`; R: rows per tile (1, 2, 4);
//! * chunk: rows per task (0 = one contiguous run per thread), mode: `kernel` or `read` (loads
//!   only: the bandwidth ceiling of the same access pattern).
//!
//! Env: `PFD` prefetch distance (8192), `STEPS` (60), `PAGES=4k|huge` (anonymous memory page
//! size), `MODEL=DIR` (take the bytes of the experts from `DIR/experts.bin`, i.e. the page
//! cache of a converted OLMoE model, instead of anonymous memory; for streaming speed only —
//! the bytes are read as whichever layout is configured).
//!
//! The kernels here skip every check: groups must be a multiple of 8 (true for OLMoE shapes).

use std::arch::x86_64::*;
use std::time::Instant;

use colibri_engine::pool::Pool;

fn env(k: &str, d: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| d.to_string())
}

#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Split,
    Row,
    Sb,
}

#[derive(Clone, Copy)]
struct Mat {
    base: usize,
    rows: usize,
    cols: usize,
}

impl Mat {
    fn groups(&self) -> usize {
        self.cols / 32
    }
    fn bytes(&self) -> usize {
        self.rows * self.groups() * 18
    }
    /// (nibble ptr, nibble stride per chunk, scale ptr, scale stride per chunk, row start)
    fn row(&self, l: Layout, r: usize) -> (usize, usize, usize, usize, usize) {
        let g = self.groups();
        match l {
            Layout::Split => (
                self.base + r * g * 16,
                128,
                self.base + self.rows * g * 16 + r * g * 2,
                16,
                self.base + r * g * 16,
            ),
            Layout::Row => {
                let s = self.base + r * g * 18;
                (s + g * 2, 128, s, 16, s)
            }
            Layout::Sb => {
                let s = self.base + r * g * 18;
                (s + 16, 144, s, 144, s)
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Cfg {
    layout: Layout,
    pf: u8, // 0 none, 1 cur, 2 line
    hint: u8,
    pfd: usize,
}

#[inline(always)]
/// # Safety
/// The CPU has SSE (prefetching any address is harmless).
unsafe fn pf(h: u8, p: *const u8) {
    // SAFETY: prefetch instructions never fault, whatever the address.
    unsafe {
        match h {
            0 => _mm_prefetch::<_MM_HINT_T0>(p.cast()),
            1 => _mm_prefetch::<_MM_HINT_T1>(p.cast()),
            _ => _mm_prefetch::<_MM_HINT_NTA>(p.cast()),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI; rows `r0..r0 + R` lie inside `m`, whose memory is mapped;
/// `m.groups()` is a multiple of 8 and `act` holds `m.cols` activations.
unsafe fn tile<const R: usize>(m: &Mat, r0: usize, cfg: Cfg, act: &Act) -> [f32; R] {
    // SAFETY: every load reads a chunk of 8 groups of a row inside `m` (mapped memory) or of
    // `act` (sized for `m.cols`); intrinsics are covered by the target features.
    unsafe {
        let groups = m.groups();
        let nch = groups / 8;
        let mut nq = [0usize; R];
        let mut ns = [0usize; R];
        let mut sq = 0;
        let mut ss = 0;
        let mut rs = [0usize; R];
        for r in 0..R {
            let (a, b, c, d, e) = m.row(cfg.layout, r0 + r);
            nq[r] = a;
            sq = b;
            ns[r] = c;
            ss = d;
            rs[r] = e;
        }
        let row_bytes = groups * 18;
        let m4 = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut cursor = [0usize; R];
        for r in 0..R {
            cursor[r] = (rs[r] + cfg.pfd) & !63;
        }
        for c in 0..nch {
            if cfg.pf != 0 {
                if cfg.layout == Layout::Split {
                    for r in 0..R {
                        let p = (nq[r] + c * 128 + cfg.pfd) as *const u8;
                        pf(cfg.hint, p);
                        pf(cfg.hint, p.wrapping_add(64));
                        if cfg.pf == 1 || (ns[r] + c * 16) % 64 < 16 {
                            pf(cfg.hint, (ns[r] + c * 16 + cfg.pfd / 8) as *const u8);
                        }
                    }
                } else {
                    for r in 0..R {
                        let target = rs[r] + (c + 1) * row_bytes / nch + cfg.pfd;
                        while cursor[r] < target {
                            pf(cfg.hint, cursor[r] as *const u8);
                            cursor[r] += 64;
                        }
                    }
                }
            }
            let mut dw = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let h = _mm_loadu_si128((ns[r] + c * ss) as *const __m128i);
                dw[r] = _mm512_castps256_ps512(_mm256_cvtph_ps(h));
            }
            for s in 0..2 {
                let g = 4 * s as i32;
                let idx = _mm512_setr_epi32(
                    g,
                    g,
                    g,
                    g,
                    g + 1,
                    g + 1,
                    g + 1,
                    g + 1,
                    g + 2,
                    g + 2,
                    g + 2,
                    g + 2,
                    g + 3,
                    g + 3,
                    g + 3,
                    g + 3,
                );
                let aoff = c * 256 + s * 128;
                let loff = c * 32 + s * 16;
                let alo = _mm512_loadu_si512(act.qs.as_ptr().add(aoff).cast());
                let ahi = _mm512_loadu_si512(act.qs.as_ptr().add(aoff + 64).cast());
                let corr = _mm512_loadu_si512(act.corr.as_ptr().add(loff).cast());
                let de = _mm512_loadu_ps(act.dexp.as_ptr().add(loff));
                for r in 0..R {
                    let v = _mm512_loadu_si512((nq[r] + c * sq + s * 64) as *const __m512i);
                    let wlo = _mm512_and_si512(v, m4);
                    let whi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    let dwe = _mm512_permutexvar_ps(idx, dw[r]);
                    let i = _mm512_dpbusd_epi32(corr, wlo, alo);
                    let i = _mm512_dpbusd_epi32(i, whi, ahi);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dwe, de), acc[r]);
                }
            }
        }
        let mut res = [0.0f32; R];
        for r in 0..R {
            res[r] = _mm512_reduce_add_ps(acc[r]);
        }
        res
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
/// # Safety
/// The CPU has AVX-512 F/BW; `rows` lie inside `m`, whose memory is mapped.
unsafe fn read_rows(m: &Mat, rows: std::ops::Range<usize>, cfg: Cfg) -> f32 {
    // SAFETY: the loads cover whole 64-byte pieces of the rows' bytes inside `m`.
    unsafe {
        let (_, _, _, _, s0) = m.row(Layout::Row, rows.start);
        let (_, _, _, _, s1) = m.row(Layout::Row, rows.end);
        let mut acc = _mm512_setzero_si512();
        let mut p = s0;
        while p + 64 <= s1 {
            if cfg.pf != 0 {
                pf(cfg.hint, (p + cfg.pfd) as *const u8);
            }
            acc = _mm512_xor_si512(acc, _mm512_loadu_si512(p as *const __m512i));
            p += 64;
        }
        _mm512_reduce_add_epi32(acc) as f32
    }
}

struct Act {
    qs: Vec<i8>,
    corr: Vec<i32>,
    dexp: Vec<f32>,
}

fn run_rows(
    m: &Mat,
    rows: std::ops::Range<usize>,
    cfg: Cfg,
    rr: usize,
    act: &Act,
    out: &mut f32,
    read: bool,
) {
    if read {
        // SAFETY: `rows` comes from splitting `0..m.rows`; the CPU check is in main.
        *out += unsafe { read_rows(m, rows, cfg) };
        return;
    }
    let mut r = rows.start;
    let mut s = 0.0;
    while r < rows.end {
        // SAFETY: rows r..r+R are inside `rows`, which is inside `m`; OLMoE shapes have groups
        // a multiple of 8 and `a` matches `m.cols`; the CPU check is in main.
        unsafe {
            if rr >= 4 && rows.end - r >= 4 {
                s += tile::<4>(m, r, cfg, act).iter().sum::<f32>();
                r += 4;
            } else if rr >= 2 && rows.end - r >= 2 {
                s += tile::<2>(m, r, cfg, act).iter().sum::<f32>();
                r += 2;
            } else {
                s += tile::<1>(m, r, cfg, act)[0];
                r += 1;
            }
        }
    }
    *out += s;
}

struct Setup {
    mats: Vec<Mat>,
    attn: Vec<Vec<usize>>,
    experts: Vec<[usize; 3]>,
    lm: usize,
    _buf: memmap2::MmapMut,
}

fn setup(layout: Layout, huge: bool) -> Setup {
    let (h, mi, vocab) = (2048, 1024, 50304);
    let mut mats: Vec<Mat> = Vec::new();
    let mut off = 0usize;
    let mut add = |rows: usize, cols: usize, mats: &mut Vec<Mat>| {
        let m = Mat {
            base: off,
            rows,
            cols,
        };
        off += m.bytes().next_multiple_of(4096);
        mats.push(m);
        mats.len() - 1
    };
    let attn: Vec<Vec<usize>> = (0..16)
        .map(|_| (0..4).map(|_| add(h, h, &mut mats)).collect())
        .collect();
    let experts: Vec<[usize; 3]> = (0..128)
        .map(|_| {
            [
                add(mi, h, &mut mats),
                add(mi, h, &mut mats),
                add(h, mi, &mut mats),
            ]
        })
        .collect();
    let lm = add(vocab, h, &mut mats);
    let mut buf = memmap2::MmapMut::map_anon(off).unwrap();
    buf.advise(if huge {
        memmap2::Advice::HugePage
    } else {
        memmap2::Advice::NoHugePage
    })
    .unwrap();
    let mut s = 0x1234_5678_9abc_def1u64;
    for ch in buf.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ch.copy_from_slice(&s.to_le_bytes()[..ch.len()]);
    }
    let base = buf.as_ptr() as usize;
    let sc = half::f16::from_f32(0.01).to_le_bytes();
    for m in mats.iter_mut() {
        m.base += base;
        for r in 0..m.rows {
            let (_, _, sp, ss, _) = m.row(layout, r);
            for c in 0..m.groups() / 8 {
                for k in 0..8 {
                    let p = sp + c * ss + 2 * k - base;
                    buf[p..p + 2].copy_from_slice(&sc);
                }
            }
        }
    }
    if let Ok(dir) = std::env::var("MODEL") {
        let f = std::fs::File::open(format!("{dir}/experts.bin")).unwrap();
        // SAFETY: read-only map of a model file nobody writes while this runs.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&f) }.unwrap();
        let b = map.as_ptr() as usize;
        let stride: usize = env("RECSTRIDE", "1").parse().unwrap();
        for (e, ex) in experts.iter().enumerate() {
            let rec = b + e * stride * 3538944;
            mats[ex[0]].base = rec;
            mats[ex[1]].base = rec + 1179648;
            mats[ex[2]].base = rec + 2359296;
        }
        std::mem::forget(map);
    }
    Setup {
        mats,
        attn,
        experts,
        lm,
        _buf: buf,
    }
}

fn main() {
    assert!(
        colibri_engine::quant::Kernel::Avx512Vnni.available(),
        "stream_proto needs AVX-512 VNNI"
    );
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    // CONFIGS="layout,pf,hint,R,chunk,mode;..."
    let confs: Vec<(Cfg, usize, usize, bool, String)> = env("CONFIGS", "split,cur,t0,2,0,kernel")
        .split(';')
        .map(|c| {
            let f: Vec<&str> = c.split(',').collect();
            let layout = match f[0] {
                "row" => Layout::Row,
                "sb" => Layout::Sb,
                _ => Layout::Split,
            };
            let cfg = Cfg {
                layout,
                pf: match f[1] {
                    "none" => 0,
                    "line" => 2,
                    _ => 1,
                },
                hint: match f[2] {
                    "t1" => 1,
                    "nta" => 2,
                    _ => 0,
                },
                pfd: env("PFD", "8192").parse().unwrap(),
            };
            (
                cfg,
                f[3].parse().unwrap(),
                f[4].parse().unwrap(),
                f[5] == "read",
                c.to_string(),
            )
        })
        .collect();
    let huge = env("PAGES", "4k") == "huge";
    let mut setups: Vec<(Layout, Setup)> = Vec::new();
    for c in &confs {
        if !setups.iter().any(|(l, _)| *l == c.0.layout) {
            setups.push((c.0.layout, setup(c.0.layout, huge)));
        }
    }
    let (h, _mi) = (2048, 1024);
    let mk = |cols: usize| Act {
        qs: (0..cols).map(|i| (i % 17) as i8 - 8).collect(),
        corr: vec![-3; cols / 8],
        dexp: vec![0.01; cols / 8],
    };
    let ah = mk(h);
    let ai = mk(1024);
    let pool = Pool::new(threads).unwrap();
    let region =
        |st: &Setup, ms: &[usize], cfg: Cfg, rr: usize, chunk: usize, read: bool| -> usize {
            let mut bytes = 0;
            let mut items: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
            for &i in ms {
                let m = &st.mats[i];
                bytes += m.bytes();
                let c = if chunk == 0 {
                    m.rows.div_ceil(threads).next_multiple_of(16)
                } else {
                    chunk
                };
                let mut r = 0;
                while r < m.rows {
                    items.push((i, r..(r + c).min(m.rows)));
                    r += c;
                }
            }
            let sink = std::sync::Mutex::new(0.0f32);
            pool.run(items.len(), |k| {
                let (i, ref rows) = items[k];
                let m = &st.mats[i];
                let a = if m.cols == h { &ah } else { &ai };
                let mut o = 0.0;
                run_rows(m, rows.clone(), cfg, rr, a, &mut o, read);
                *sink.lock().unwrap() += o;
            });
            std::hint::black_box(sink.into_inner().unwrap());
            bytes
        };
    let mut rng = 77u64;
    let steps: usize = env("STEPS", "60").parse().unwrap();
    let mut tot = vec![0.0f64; confs.len()];
    let mut bytes = vec![0usize; confs.len()];
    for step in 0..steps + 2 {
        for (ci, (cfg, rr, chunk, read, _)) in confs.iter().enumerate() {
            let st = &setups.iter().find(|(l, _)| *l == cfg.layout).unwrap().1;
            let t0 = Instant::now();
            let mut b = 0;
            for l in 0..16 {
                b += region(st, &st.attn[l][0..3], *cfg, *rr, *chunk, *read);
                b += region(st, &st.attn[l][3..4], *cfg, *rr, *chunk, *read);
                let mut sel = Vec::new();
                while sel.len() < 8 {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let e = (rng % 128) as usize;
                    if !sel.contains(&e) {
                        sel.push(e);
                    }
                }
                let gu: Vec<usize> = sel
                    .iter()
                    .flat_map(|&e| [st.experts[e][0], st.experts[e][1]])
                    .collect();
                let d: Vec<usize> = sel.iter().map(|&e| st.experts[e][2]).collect();
                b += region(st, &gu, *cfg, *rr, *chunk, *read);
                b += region(st, &d, *cfg, *rr, *chunk, *read);
            }
            b += region(st, &[st.lm], *cfg, *rr, *chunk, *read);
            if step >= 2 {
                tot[ci] += t0.elapsed().as_secs_f64();
                bytes[ci] += b;
            }
        }
    }
    for (ci, c) in confs.iter().enumerate() {
        println!(
            "{:32} t{threads}: {:.1} tok/s  {:.1} GB/s",
            c.4,
            steps as f64 / tot[ci],
            bytes[ci] as f64 / tot[ci] / 1e9
        );
    }
}
