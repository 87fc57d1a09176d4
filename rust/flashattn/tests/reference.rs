//! The float64 reference the tests use (the C++ suite's, through libflashattn_reference: see
//! common/reference.rs) is checked through this binding before it judges the library: its
//! gradients against central finite differences of its forward, its forward against cases with a
//! known answer, and a bad shape comes back as the library's message.
mod common;

use common::reference::{backward, forward, visible, Rng, Shape};
use common::MASKS;
use flashattn::Mask;

fn loss(s: &Shape, q: &[f64], k: &[f64], v: &[f64], dout: &[f64], scale: f64, mask: Mask) -> f64 {
    let (out, _) = forward(s, q, k, v, scale, mask);
    out.iter().zip(dout).map(|(o, g)| o * g).sum()
}

#[test]
fn gradients_match_finite_differences() {
    // GQA (2 query heads per kv head), Sq != Skv both ways, every mask; Sq > Skv with the
    // bottom-right mask has rows that see no key.
    let shapes = [
        Shape { batch: 2, heads_q: 2, heads_kv: 1, seq_q: 3, seq_kv: 5, head_dim: 3 },
        Shape { batch: 1, heads_q: 2, heads_kv: 2, seq_q: 5, seq_kv: 3, head_dim: 2 },
    ];
    let mut rng = Rng::new(7);
    for s in shapes {
        for mask in MASKS {
            let q = rng.normals(s.q_len());
            let k = rng.normals(s.kv_len());
            let v = rng.normals(s.kv_len());
            let dout = rng.normals(s.q_len());
            let scale = 0.7;
            let (dq, dk, dv) = backward(&s, &q, &k, &v, &dout, scale, mask);
            let h = 1e-6;
            let mut worst: f64 = 0.0;
            for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
                for idx in 0..grad.len() {
                    let mut args = [q.clone(), k.clone(), v.clone()];
                    args[which][idx] += h;
                    let up = loss(&s, &args[0], &args[1], &args[2], &dout, scale, mask);
                    args[which][idx] -= 2.0 * h;
                    let down = loss(&s, &args[0], &args[1], &args[2], &dout, scale, mask);
                    let fd = (up - down) / (2.0 * h);
                    let err = (fd - grad[idx]).abs() / (1.0 + grad[idx].abs());
                    worst = worst.max(err);
                    assert!(
                        err < 1e-7,
                        "{s:?} {mask:?} grad {which}[{idx}]: fd {fd} vs {}",
                        grad[idx]
                    );
                }
            }
            assert!(worst.is_finite());
        }
    }
}

#[test]
fn uniform_scores_average_the_visible_values() {
    // q = 0 makes every visible score 0: out is the mean of the visible v rows and lse the log
    // of their count, which tests the mask bookkeeping independently of the softmax code.
    let s = Shape { batch: 1, heads_q: 3, heads_kv: 1, seq_q: 6, seq_kv: 4, head_dim: 2 };
    let mut rng = Rng::new(3);
    let q = vec![0.0; s.q_len()];
    let k = rng.normals(s.kv_len());
    let v = rng.normals(s.kv_len());
    for mask in MASKS {
        let (out, lse) = forward(&s, &q, &k, &v, 1.0, mask);
        for h in 0..s.heads_q {
            for i in 0..s.seq_q {
                let vis: Vec<usize> =
                    (0..s.seq_kv).filter(|&j| visible(mask, i, j, s.seq_q, s.seq_kv)).collect();
                let row = (h * s.seq_q + i) * s.head_dim;
                let l = lse[h * s.seq_q + i];
                if vis.is_empty() {
                    assert_eq!(l, f64::NEG_INFINITY);
                    assert!(out[row..row + s.head_dim].iter().all(|&x| x == 0.0));
                    continue;
                }
                assert!((l - (vis.len() as f64).ln()).abs() < 1e-12);
                for c in 0..s.head_dim {
                    let mean: f64 =
                        vis.iter().map(|&j| v[j * s.head_dim + c]).sum::<f64>() / vis.len() as f64;
                    assert!((out[row + c] - mean).abs() < 1e-12);
                }
            }
        }
    }
    // Bottom-right with Sq = 6 > Skv = 4: rows 0 and 1 see nothing, row 2 sees key 0.
    assert!(!visible(Mask::CausalBottomRight, 1, 0, 6, 4));
    assert!(visible(Mask::CausalBottomRight, 2, 0, 6, 4));
    assert!(!visible(Mask::CausalBottomRight, 2, 1, 6, 4));
    // Top-left with Sq < Skv: row 0 sees key 0 only.
    assert!(visible(Mask::CausalTopLeft, 0, 0, 2, 5) && !visible(Mask::CausalTopLeft, 0, 1, 2, 5));
}

#[test]
#[should_panic(expected = "heads_kv does not divide heads_q")]
fn a_bad_shape_is_refused_with_the_reference_s_message() {
    let s = Shape { batch: 1, heads_q: 3, heads_kv: 2, seq_q: 2, seq_kv: 2, head_dim: 2 };
    let _ = forward(
        &s,
        &vec![0.0; s.q_len()],
        &vec![0.0; s.kv_len()],
        &vec![0.0; s.kv_len()],
        1.0,
        Mask::None,
    );
}
