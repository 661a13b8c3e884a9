//! Choosing the next token from logits: greedy at temperature 0, else temperature and nucleus
//! (top-p) sampling from a seeded generator, so a given seed reproduces its output.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: StdRng,
}

pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    /// `seed`: None draws one from the OS.
    pub fn new(temperature: f32, top_p: f32, seed: Option<u64>) -> Sampler {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => rand::make_rng(),
        };
        Sampler {
            temperature,
            top_p,
            rng,
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> usize {
        if self.temperature <= 0.0 {
            return argmax(logits);
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(usize, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i, ((l - max) / self.temperature).exp()))
            .collect();
        let total: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= total);
        if self.top_p < 1.0 {
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p.1;
                if acc >= self.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep.max(1));
        }
        let mass: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random::<f32>() * mass;
        for &(i, p) in &probs {
            if r < p {
                return i;
            }
            r -= p;
        }
        probs.last().map(|p| p.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_temperature_is_argmax() {
        let mut s = Sampler::new(0.0, 1.0, Some(1));
        assert_eq!(s.sample(&[0.1, 3.0, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut a = Sampler::new(1.0, 0.9, Some(7));
        let mut b = Sampler::new(1.0, 0.9, Some(7));
        let da: Vec<usize> = (0..20).map(|_| a.sample(&logits)).collect();
        let db: Vec<usize> = (0..20).map(|_| b.sample(&logits)).collect();
        assert_eq!(da, db);
    }

    #[test]
    fn tiny_top_p_keeps_only_the_best() {
        let mut s = Sampler::new(1.0, 1e-6, Some(3));
        for _ in 0..10 {
            assert_eq!(s.sample(&[0.0, 5.0, 1.0]), 1);
        }
    }
}
