//! Shared test harness: lays logical [B, H, S, D] data out in a memory layout, runs the library
//! through the safe API with NaN-poisoned outputs, and compares with the float64 reference (the
//! C++ suite's, through libflashattn_reference: `reference`).
#![allow(dead_code)]

pub mod reference;

use flashattn::{backward, forward, Element, Error, Mask, Options, Tensor, TensorMut, Window};
pub use reference::{visible_in, Mods, Rng, Shape};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Contiguous [B, H, S, D] (`Tensor::bhsd`).
    Bhsd,
    /// Contiguous [B, S, H, D] (`Tensor::bshd`).
    Bshd,
    /// [B, H, S, D] order with gaps after every row, head and batch (`Tensor::new` with strides);
    /// the gaps hold NaN, so reading or writing outside the view shows.
    Padded,
}

pub const LAYOUTS: [Layout; 3] = [Layout::Bhsd, Layout::Bshd, Layout::Padded];
pub const MASKS: [Mask; 3] = [Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight];

/// Logical shape, strides and buffer length of a [b, h, s, d] tensor in `layout`.
pub fn strides_of(layout: Layout, [b, h, s, d]: [usize; 4]) -> ([usize; 4], usize) {
    match layout {
        Layout::Bhsd => ([h * s * d, s * d, d, 1], b * h * s * d),
        Layout::Bshd => ([s * h * d, d, h * d, 1], b * s * h * d),
        Layout::Padded => {
            let row = d + 3;
            let head = s * row + 5;
            let batch = h * head + 7;
            ([batch, head, row, 1], b * batch)
        }
    }
}

fn offset(strides: &[usize], idx: &[usize]) -> usize {
    strides.iter().zip(idx).map(|(s, i)| s * i).sum()
}

/// Calls `f(logical_index, buffer_offset)` for every element of a 4-d view.
fn for_each4(dims: [usize; 4], strides: &[usize], mut f: impl FnMut(usize, usize)) {
    let mut n = 0;
    for b in 0..dims[0] {
        for h in 0..dims[1] {
            for s in 0..dims[2] {
                for d in 0..dims[3] {
                    f(n, offset(strides, &[b, h, s, d]));
                    n += 1;
                }
            }
        }
    }
}

pub fn scatter<T: Element>(logical: &[f64], dims: [usize; 4], layout: Layout) -> Vec<T> {
    let (strides, len) = strides_of(layout, dims);
    let mut buf = vec![T::from_f64(f64::NAN); len];
    for_each4(dims, &strides, |n, o| buf[o] = T::from_f64(logical[n]));
    buf
}

pub fn gather<T: Element>(buf: &[T], dims: [usize; 4], layout: Layout) -> Vec<f64> {
    let (strides, _) = strides_of(layout, dims);
    let mut out = vec![0.0; dims.iter().product()];
    for_each4(dims, &strides, |n, o| out[n] = buf[o].to_f64());
    out
}

/// Elements of `buf` outside the view, which must still hold their NaN poison.
pub fn gaps_untouched<T: Element>(buf: &[T], dims: [usize; 4], layout: Layout) -> bool {
    let (strides, _) = strides_of(layout, dims);
    let mut inside = vec![false; buf.len()];
    for_each4(dims, &strides, |_, o| inside[o] = true);
    buf.iter().zip(&inside).all(|(x, &i)| i || x.to_f64().is_nan())
}

pub fn input<'a, T: Element>(buf: &'a [T], dims: [usize; 4], layout: Layout) -> Tensor<'a, T> {
    let [b, h, s, d] = dims;
    match layout {
        Layout::Bhsd => Tensor::bhsd(buf, dims),
        Layout::Bshd => Tensor::bshd(buf, [b, s, h, d]),
        Layout::Padded => Tensor::new(buf, &dims, &strides_of(layout, dims).0),
    }
    .unwrap()
}

pub fn output<'a, T: Element>(
    buf: &'a mut [T],
    dims: [usize; 4],
    layout: Layout,
) -> TensorMut<'a, T> {
    let [b, h, s, d] = dims;
    match layout {
        Layout::Bhsd => TensorMut::bhsd(buf, dims),
        Layout::Bshd => TensorMut::bshd(buf, [b, s, h, d]),
        Layout::Padded => TensorMut::new(buf, &dims, &strides_of(layout, dims).0),
    }
    .unwrap()
}

/// LSE [B, H, Sq]: contiguous, or with gaps in the padded layout.
pub fn lse_strides(layout: Layout, [b, h, s]: [usize; 3]) -> ([usize; 3], usize) {
    match layout {
        Layout::Padded => ([h * (s + 2) + 1, s + 2, 1], b * (h * (s + 2) + 1)),
        _ => ([h * s, s, 1], b * h * s),
    }
}

/// Which ALiBi slopes a case uses (made by [`Case::slopes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alibi {
    None,
    /// `[Hq]`: the ALiBi paper's geometric series 2^(-8 (h + 1) / Hq).
    Heads,
    /// `[B, Hq]`: random slopes in [0, 1.5), the first one negative (-0.25).
    Batch,
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub shape: Shape,
    pub mask: Mask,
    pub layout: Layout,
    pub scale: Option<f32>,
    pub threads: u32,
    pub deterministic: bool,
    pub window: Option<Window>,
    pub softcap: Option<f32>,
    pub alibi: Alibi,
}

impl Case {
    pub fn new(s: [usize; 6], mask: Mask, layout: Layout) -> Self {
        let [batch, heads_q, heads_kv, seq_q, seq_kv, head_dim] = s;
        Case {
            shape: Shape { batch, heads_q, heads_kv, seq_q, seq_kv, head_dim },
            mask,
            layout,
            scale: None,
            threads: 0,
            deterministic: false,
            window: None,
            softcap: None,
            alibi: Alibi::None,
        }
    }
    /// The options without ALiBi slopes (see [`Case::options_with`]).
    pub fn options(&self) -> Options<'static> {
        Options {
            softmax_scale: self.scale,
            mask: self.mask,
            num_threads: self.threads,
            deterministic: self.deterministic,
            window: self.window,
            softcap: self.softcap,
            ..Options::default()
        }
    }
    /// The options with `slopes` as the ALiBi slopes.
    pub fn options_with<'a>(&self, slopes: Option<Tensor<'a, f32>>) -> Options<'a> {
        Options { alibi_slopes: slopes, ..self.options() }
    }
    /// The case's ALiBi slopes (empty for none) and their shape.
    pub fn slopes(&self) -> (Vec<f32>, Vec<usize>) {
        let (b, h) = (self.shape.batch, self.shape.heads_q);
        match self.alibi {
            Alibi::None => (vec![], vec![]),
            Alibi::Heads => {
                let s = (0..h).map(|i| (-8.0 * (i + 1) as f64 / h as f64).exp2() as f32).collect();
                (s, vec![h])
            }
            Alibi::Batch => {
                let mut rng = Rng::new(4242);
                let mut s: Vec<f32> = (0..b * h).map(|_| (1.5 * rng.uniform()) as f32).collect();
                s[0] = -0.25;
                (s, vec![b, h])
            }
        }
    }
    /// The reference's view of the window, softcap and slopes: the float32 values the library
    /// gets, slopes repeated over the batch when given per head.
    pub fn ref_mods(&self) -> Mods {
        let (slopes, dims) = self.slopes();
        let (b, h) = (self.shape.batch, self.shape.heads_q);
        let alibi = if slopes.is_empty() {
            vec![]
        } else if dims.len() == 1 {
            (0..b * h).map(|i| slopes[i % h] as f64).collect()
        } else {
            slopes.iter().map(|&x| x as f64).collect()
        };
        Mods { window: self.window, softcap: self.softcap.unwrap_or(0.0) as f64, alibi }
    }
    pub fn visible(&self, i: usize, j: usize) -> bool {
        visible_in(self.mask, self.window, i, j, self.shape.seq_q, self.shape.seq_kv)
    }
    pub fn q_dims(&self) -> [usize; 4] {
        let s = &self.shape;
        [s.batch, s.heads_q, s.seq_q, s.head_dim]
    }
    pub fn kv_dims(&self) -> [usize; 4] {
        let s = &self.shape;
        [s.batch, s.heads_kv, s.seq_kv, s.head_dim]
    }
    pub fn scale_f64(&self) -> f64 {
        match self.scale {
            Some(x) if x != 0.0 => x as f64,
            _ => self.shape.default_scale(),
        }
    }
}

/// Logical float64 inputs, already rounded to T so the reference sees exactly what the library
/// sees.
pub struct Inputs {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub dout: Vec<f64>,
}

impl Inputs {
    pub fn random<T: Element>(case: &Case, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut gen = |n| -> Vec<f64> {
            rng.normals(n).into_iter().map(|x| T::from_f64(x).to_f64()).collect()
        };
        let s = &case.shape;
        Inputs { q: gen(s.q_len()), k: gen(s.kv_len()), v: gen(s.kv_len()), dout: gen(s.q_len()) }
    }
}

/// The library's results, logical and in float64, plus their raw bits for determinism checks.
#[derive(Debug, PartialEq)]
pub struct Results {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Runs forward then backward through the safe API, outputs poisoned with NaN beforehand.
pub fn run_library<T: Element>(case: &Case, x: &Inputs) -> Result<Results, Error> {
    let (qd, kd, layout) = (case.q_dims(), case.kv_dims(), case.layout);
    let s = &case.shape;
    let q = scatter::<T>(&x.q, qd, layout);
    let k = scatter::<T>(&x.k, kd, layout);
    let v = scatter::<T>(&x.v, kd, layout);
    let dout = scatter::<T>(&x.dout, qd, layout);
    let nan = T::from_f64(f64::NAN);
    let mut out = vec![nan; strides_of(layout, qd).1];
    let lse_dims = [s.batch, s.heads_q, s.seq_q];
    let (lse_st, lse_len) = lse_strides(layout, lse_dims);
    let mut lse = vec![f32::NAN; lse_len];
    let (slopes, slope_dims) = case.slopes();
    let slopes_t = (!slopes.is_empty()).then(|| Tensor::contiguous(&slopes, &slope_dims).unwrap());
    let opts = case.options_with(slopes_t);

    let (qt, kt, vt) = (input(&q, qd, layout), input(&k, kd, layout), input(&v, kd, layout));
    {
        let mut ot = output(&mut out, qd, layout);
        let mut lt = TensorMut::new(&mut lse, &lse_dims, &lse_st).unwrap();
        forward(&qt, &kt, &vt, &mut ot, &mut lt, &opts)?;
    }
    assert!(gaps_untouched(&out, qd, layout), "forward wrote outside out's view");

    let mut dq = vec![nan; strides_of(layout, qd).1];
    let mut dk = vec![nan; strides_of(layout, kd).1];
    let mut dv = vec![nan; strides_of(layout, kd).1];
    backward(
        &qt,
        &kt,
        &vt,
        &input(&out, qd, layout),
        &input(&dout, qd, layout),
        &Tensor::new(&lse, &lse_dims, &lse_st).unwrap(),
        &mut output(&mut dq, qd, layout),
        &mut output(&mut dk, kd, layout),
        &mut output(&mut dv, kd, layout),
        &opts,
    )?;
    assert!(gaps_untouched(&dq, qd, layout), "backward wrote outside dq's view");
    assert!(gaps_untouched(&dk, kd, layout), "backward wrote outside dk's view");
    assert!(gaps_untouched(&dv, kd, layout), "backward wrote outside dv's view");

    let mut lse_logical = Vec::with_capacity(s.lse_len());
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            for i in 0..s.seq_q {
                lse_logical.push(lse[b * lse_st[0] + h * lse_st[1] + i] as f64);
            }
        }
    }
    Ok(Results {
        out: gather(&out, qd, layout),
        lse: lse_logical,
        dq: gather(&dq, qd, layout),
        dk: gather(&dk, kd, layout),
        dv: gather(&dv, kd, layout),
    })
}

/// Worst of |got - want| / (1 + |want|) over a tensor; NaN anywhere, or a mismatch of infinities,
/// counts as infinitely bad.
pub fn max_error(got: &[f64], want: &[f64]) -> (f64, usize) {
    assert_eq!(got.len(), want.len());
    let mut worst = (0.0, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = if w.is_infinite() || g.is_infinite() {
            if g == w {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            let e = (g - w).abs() / (1.0 + w.abs());
            if e.is_nan() {
                f64::INFINITY
            } else {
                e
            }
        };
        if e > worst.0 {
            worst = (e, i);
        }
    }
    worst
}

/// Exact conditions that hold whatever the precision: a query row that sees no key (under the
/// mask and the window) has out = 0, lse = -inf and dq = 0; a key that no query sees has
/// dk = dv = 0. Returns the number of such rows.
pub fn check_masked_exactly(case: &Case, r: &Results) -> usize {
    let s = &case.shape;
    let d = s.head_dim;
    let mut rows = 0;
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            for i in 0..s.seq_q {
                if (0..s.seq_kv).any(|j| case.visible(i, j)) {
                    continue;
                }
                rows += 1;
                let row = ((b * s.heads_q + h) * s.seq_q + i) * d;
                let ctx = format!("{case:?}: row b={b} h={h} i={i} sees no key");
                assert_eq!(
                    r.lse[(b * s.heads_q + h) * s.seq_q + i],
                    f64::NEG_INFINITY,
                    "{ctx}: lse"
                );
                assert!(
                    r.out[row..row + d].iter().all(|&x| x == 0.0),
                    "{ctx}: out {:?}",
                    &r.out[row..row + d]
                );
                assert!(
                    r.dq[row..row + d].iter().all(|&x| x == 0.0),
                    "{ctx}: dq {:?}",
                    &r.dq[row..row + d]
                );
            }
        }
        for h in 0..s.heads_kv {
            for j in 0..s.seq_kv {
                if (0..s.seq_q).any(|i| case.visible(i, j)) {
                    continue;
                }
                let row = ((b * s.heads_kv + h) * s.seq_kv + j) * d;
                let ctx = format!("{case:?}: key b={b} h={h} j={j} seen by no query");
                assert!(r.dk[row..row + d].iter().all(|&x| x == 0.0), "{ctx}: dk");
                assert!(r.dv[row..row + d].iter().all(|&x| x == 0.0), "{ctx}: dv");
            }
        }
    }
    rows
}

/// Error bounds, as |got - ref| / (1 + |ref|), per output.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub out: f64,
    pub lse: f64,
    /// dq, dk, dv
    pub grad: f64,
}

/// Runs one case against the reference; panics with the worst error when any output is off by
/// more than `tol` (relative to 1 + |reference|). Returns the worst error seen.
pub fn check_case<T: Element>(case: &Case, seed: u64, tol: Tol) -> f64 {
    let x = Inputs::random::<T>(case, seed);
    let s = &case.shape;
    let scale = case.scale_f64();
    let mods = case.ref_mods();
    let (out, lse) = reference::forward_ex(s, &x.q, &x.k, &x.v, scale, case.mask, &mods);
    let (dq, dk, dv) =
        reference::backward_ex(s, &x.q, &x.k, &x.v, &x.dout, scale, case.mask, &mods);
    let r = run_library::<T>(case, &x).unwrap_or_else(|e| panic!("{case:?}: {e}"));
    let mut worst: f64 = 0.0;
    for (name, got, want) in [
        ("out", &r.out, &out),
        ("lse", &r.lse, &lse),
        ("dq", &r.dq, &dq),
        ("dk", &r.dk, &dk),
        ("dv", &r.dv, &dv),
    ] {
        let tol = match name {
            "out" => tol.out,
            "lse" => tol.lse,
            _ => tol.grad,
        };
        if std::env::var_os("FLASHATTN_TEST_VERBOSE").is_some() {
            println!("{:?} {name}: {:.2e}", T::DTYPE, max_error(got, want).0);
        }
        let (e, i) = max_error(got, want);
        assert!(
            e <= tol,
            "{case:?} ({:?}): {name} error {e:.3e} > {tol:.1e} at {i}: got {}, want {}",
            T::DTYPE,
            got[i],
            want[i]
        );
        worst = worst.max(e);
    }
    check_masked_exactly(case, &r);
    worst
}

/// Shapes as [B, Hq, Hkv, Sq, Skv, D]: sizes 1, 17, 33; Sq != Skv both ways; GQA and MQA.
pub const SHAPES: [[usize; 6]; 6] = [
    [1, 1, 1, 1, 1, 1],
    [2, 2, 2, 17, 17, 33],
    [1, 4, 2, 17, 33, 16],
    [2, 3, 1, 33, 17, 8],
    [1, 2, 1, 1, 33, 64],
    [1, 6, 3, 33, 33, 17],
];
