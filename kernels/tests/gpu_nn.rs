//! The GPT's layer kernels (`cu/nn.cu`: the layers, the bias add and the attention heads'
//! permutations), in f32 and the bf16 and f16 roundings of results only products read, on the
//! GPU against their host twins (`fsdp_kernels::host::nn`), **bitwise**:
//! e^x, ln and erfc are the programs' own functions of IEEE operations (no CUDA math library),
//! every operation is spelled with its rounding and compiled without fused multiply-adds, and
//! every reduction has the twin's fixed order. Shapes cover rows shorter and longer than a
//! block (256), repeated ids, an id and a target out of range (NaN rows). Without a GPU each
//! test prints `skipped: no GPU (<reason>)` and passes.

mod common;

use std::sync::Arc;

use common::{data, down, gpu_stream, up};
use cudarc::driver::{CudaSlice, CudaStream};
use fsdp_kernels::host::{self, f32_to_bf16, f32_to_f16, nn};
use fsdp_kernels::launch;
use half::{bf16, f16};

/// A kernel's bf16 output (on the GPU) against its twin's f32 values rounded as the cast
/// kernel rounds: equal bits.
#[track_caller]
fn same_bf16(what: &str, s: &Arc<CudaStream>, gpu: &CudaSlice<bf16>, host: &[f32]) {
    let got: Vec<u16> = down(s, gpu).iter().map(|x| x.to_bits()).collect();
    let want: Vec<u16> = host.iter().map(|&x| f32_to_bf16(x)).collect();
    assert_eq!(got, want, "{what}: bf16 bits");
}

/// A bf16 buffer of `n` NaNs (a kernel must write every element).
fn nan_bf16(s: &Arc<CudaStream>, n: usize) -> CudaSlice<bf16> {
    up(s, &vec![bf16::NAN; n])
}

/// [`same_bf16`] in f16: the cast kernel's f16 rounding (infinite past f16's range).
#[track_caller]
fn same_f16(what: &str, s: &Arc<CudaStream>, gpu: &CudaSlice<f16>, host: &[f32]) {
    let got: Vec<u16> = down(s, gpu).iter().map(|x| x.to_bits()).collect();
    let want: Vec<u16> = host.iter().map(|&x| f32_to_f16(x)).collect();
    assert_eq!(got, want, "{what}: f16 bits");
}

/// An f16 buffer of `n` NaNs.
fn nan_f16(s: &Arc<CudaStream>, n: usize) -> CudaSlice<f16> {
    up(s, &vec![f16::NAN; n])
}

/// `$launch` (a launcher writing `$y`) into `$n` NaNs of bf16, then of f16, each held to the
/// twin's f32 values `$host` rounded as the cast kernel rounds: every 16-bit kernel.
macro_rules! both_halves {
    ($what:expr, $s:expr, $n:expr, $host:expr, |$y:ident| $launch:expr) => {{
        let mut $y = nan_bf16($s, $n);
        $launch.unwrap();
        same_bf16(&$what, $s, &$y, $host);
        let mut $y = nan_f16($s, $n);
        $launch.unwrap();
        same_f16(&$what, $s, &$y, $host);
    }};
}

/// Equal bits (NaN results: both NaN).
#[track_caller]
fn same(what: &str, gpu: &[f32], host: &[f32]) {
    assert_eq!(gpu.len(), host.len(), "{what}: lengths");
    for (i, (a, b)) in gpu.iter().zip(host).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{what} [{i}]: GPU {a:e} ({:#x}) vs host {b:e} ({:#x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

#[test]
fn layernorm_equals_its_twin() {
    let Some(s) = gpu_stream("layernorm_equals_its_twin") else {
        return;
    };
    // 600 rows: three chunks of the column reduction, the last one partial.
    for (n, c) in [(33usize, 48usize), (64, 768), (5, 1000), (600, 40)] {
        let x = data(n * c, 1, 4.0);
        let (w, b, dy) = (data(c, 2, 1.0), data(c, 3, 1.0), data(n * c, 4, 1.0));
        let (mut y, mut m, mut r) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        nn::layernorm_forward(&x, &w, &b, 1e-5, &mut y, &mut m, &mut r).unwrap();
        let (dx_, dw_, db_) = (
            x.iter().map(|v| v * 0.1).collect::<Vec<_>>(),
            data(c, 5, 1.0),
            data(c, 6, 1.0),
        );
        let (mut dx, mut dw, mut db) = (dx_.clone(), dw_.clone(), db_.clone());
        nn::layernorm_backward_input(&dy, &x, &w, &m, &r, &mut dx).unwrap();
        nn::layernorm_backward_params(&dy, &x, &m, &r, &mut dw, &mut db).unwrap();

        let (gx, gw, gb, gdy) = (up(&s, &x), up(&s, &w), up(&s, &b), up(&s, &dy));
        let mut gy = s.alloc_zeros::<f32>(n * c).unwrap();
        let (mut gm, mut gr) = (
            s.alloc_zeros::<f32>(n).unwrap(),
            s.alloc_zeros::<f32>(n).unwrap(),
        );
        launch::layernorm_forward(&s, &gx, &gw, &gb, 1e-5, &mut gy, &mut gm, &mut gr).unwrap();
        same("layernorm y", &down(&s, &gy), &y);
        same("layernorm mean", &down(&s, &gm), &m);
        same("layernorm rstd", &down(&s, &gr), &r);
        // y written in bf16 (an operand of products): the same statistics.
        both_halves!("layernorm y", &s, n * c, &y, |hy| {
            launch::layernorm_forward(&s, &gx, &gw, &gb, 1e-5, &mut hy, &mut gm, &mut gr)
        });
        same("layernorm mean (bf16 y)", &down(&s, &gm), &m);
        same("layernorm rstd (bf16 y)", &down(&s, &gr), &r);
        let (mut gdx, mut gdw, mut gdb) = (up(&s, &dx_), up(&s, &dw_), up(&s, &db_));
        launch::layernorm_backward_input(&s, &gdy, &gx, &gw, &gm, &gr, &mut gdx).unwrap();
        launch::layernorm_backward_params(&s, &gdy, &gx, &gm, &gr, &mut gdw, &mut gdb).unwrap();
        same("layernorm dx", &down(&s, &gdx), &dx);
        same("layernorm dweight", &down(&s, &gdw), &dw);
        same("layernorm dbias", &down(&s, &gdb), &db);
    }
}

#[test]
fn gelu_equals_its_twin() {
    let Some(s) = gpu_stream("gelu_equals_its_twin") else {
        return;
    };
    let mut x = data(1 << 20, 11, 12.0);
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1e-40,
        -30.0,
        30.0,
    ]);
    let dy = data(x.len(), 12, 3.0);
    let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    nn::gelu_forward(&x, &mut y).unwrap();
    nn::gelu_backward(&x, &dy, &mut dx).unwrap();
    let (gx, gdy) = (up(&s, &x), up(&s, &dy));
    let (mut gy, mut gdx) = (
        s.alloc_zeros::<f32>(x.len()).unwrap(),
        s.alloc_zeros::<f32>(x.len()).unwrap(),
    );
    launch::gelu_forward(&s, &gx, &mut gy).unwrap();
    launch::gelu_backward(&s, &gx, &gdy, &mut gdx).unwrap();
    same("gelu y", &down(&s, &gy), &y);
    same("gelu dx", &down(&s, &gdx), &dx);
    both_halves!("gelu y", &s, x.len(), &y, |hy| launch::gelu_forward(
        &s, &gx, &mut hy
    ));
}

#[test]
fn causal_softmax_equals_its_twin() {
    let Some(s) = gpu_stream("causal_softmax_equals_its_twin") else {
        return;
    };
    for (bh, t) in [(7usize, 5usize), (4, 300), (2, 1024)] {
        let scale = 1.0 / 8.0f32.sqrt();
        let sc = data(bh * t * t, 21, 20.0);
        let dp = data(bh * t * t, 22, 1.0);
        let mut p = vec![0.0; sc.len()];
        nn::causal_softmax_forward(&sc, t, scale, &mut p).unwrap();
        let mut ds = vec![0.0; sc.len()];
        nn::causal_softmax_backward(&p, &dp, t, scale, &mut ds).unwrap();
        let (gs, gdp) = (up(&s, &sc), up(&s, &dp));
        // Start from garbage: the kernels must write the masked half too.
        let mut gp = up(&s, &vec![f32::NAN; sc.len()]);
        launch::causal_softmax_forward(&s, &gs, t, scale, &mut gp).unwrap();
        same("softmax p", &down(&s, &gp), &p);
        let mut gds = up(&s, &vec![f32::NAN; sc.len()]);
        launch::causal_softmax_backward(&s, &gp, &gdp, t, scale, &mut gds).unwrap();
        same("softmax ds", &down(&s, &gds), &ds);
        // Written as bf16 (operands of products only): the twin's values rounded as the cast
        // kernel rounds, the masked half included.
        both_halves!(format!("softmax p, {bh}x{t}x{t}"), &s, sc.len(), &p, |hp| {
            launch::causal_softmax_forward(&s, &gs, t, scale, &mut hp)
        });
        // Both at once: the f32 probabilities and their rounding.
        let (mut bp, mut bh16) = (up(&s, &vec![f32::NAN; sc.len()]), nan_bf16(&s, sc.len()));
        launch::causal_softmax_forward_both(&s, &gs, t, scale, &mut bp, &mut bh16).unwrap();
        same("softmax p (both)", &down(&s, &bp), &p);
        same_bf16(&format!("softmax p (both), {bh}x{t}x{t}"), &s, &bh16, &p);
        let (mut bp, mut bf16s) = (up(&s, &vec![f32::NAN; sc.len()]), nan_f16(&s, sc.len()));
        launch::causal_softmax_forward_both(&s, &gs, t, scale, &mut bp, &mut bf16s).unwrap();
        same("softmax p (both, f16)", &down(&s, &bp), &p);
        same_f16(&format!("softmax p (both), {bh}x{t}x{t}"), &s, &bf16s, &p);
        both_halves!(
            format!("softmax ds, {bh}x{t}x{t}"),
            &s,
            sc.len(),
            &ds,
            |hds| { launch::causal_softmax_backward(&s, &gp, &gdp, t, scale, &mut hds) }
        );
    }
}

#[test]
fn cross_entropy_equals_its_twin() {
    let Some(s) = gpu_stream("cross_entropy_equals_its_twin") else {
        return;
    };
    for (n, v) in [(9usize, 100usize), (64, 50_257)] {
        let logits = data(n * v, 31, 15.0);
        let mut targets: Vec<u32> = (0..n).map(|r| (r * 7919 % v) as u32).collect();
        targets[n - 1] = v as u32; // out of range: a NaN row
        let dloss = 1.0 / n as f32;
        let (mut loss, mut d) = (vec![0.0; n], vec![0.0; n * v]);
        nn::cross_entropy_fused(&logits, &targets, v, dloss, &mut loss, &mut d).unwrap();
        assert!(loss[..n - 1].iter().all(|l| l.is_finite()) && loss[n - 1].is_nan());
        let (gl, gt) = (up(&s, &logits), up(&s, &targets));
        let (mut gloss, mut gd) = (
            s.alloc_zeros::<f32>(n).unwrap(),
            s.alloc_zeros::<f32>(n * v).unwrap(),
        );
        launch::cross_entropy_fused(&s, &gl, &gt, v, dloss, None, &mut gloss, &mut gd).unwrap();
        same("cross-entropy losses", &down(&s, &gloss), &loss);
        same("cross-entropy dlogits", &down(&s, &gd), &d);
        // In place: the gradient over the logits, the same bits.
        let (mut gl, mut gloss) = (up(&s, &logits), s.alloc_zeros::<f32>(n).unwrap());
        launch::cross_entropy_fused_in_place(&s, &mut gl, &gt, v, dloss, None, &mut gloss).unwrap();
        same("in-place cross-entropy losses", &down(&s, &gloss), &loss);
        same("in-place cross-entropy dlogits", &down(&s, &gl), &d);
        // The gradient written in bf16 (an operand of the head's products), the NaN row too.
        let (gl, mut gloss, mut hd) = (
            up(&s, &logits),
            s.alloc_zeros::<f32>(n).unwrap(),
            nan_bf16(&s, n * v),
        );
        launch::cross_entropy_fused(&s, &gl, &gt, v, dloss, None, &mut gloss, &mut hd).unwrap();
        same(
            "cross-entropy losses (bf16 gradient)",
            &down(&s, &gloss),
            &loss,
        );
        same_bf16("cross-entropy dlogits", &s, &hd, &d);
        let mut hd = nan_f16(&s, n * v);
        launch::cross_entropy_fused(&s, &gl, &gt, v, dloss, None, &mut gloss, &mut hd).unwrap();
        same_f16("cross-entropy dlogits", &s, &hd, &d);
        // Under a grad scaler, the seed times the scale read from the step's scalars (one of
        // 2^16, one not a power of two): the twin's scaled seed, the losses unscaled.
        for scale in [65536.0f32, 1000.0] {
            let sc = host::step_scalars(0, Some((scale, 0, 0)));
            let seed = host::scaled_seed("cross_entropy", dloss, Some(&sc)).unwrap();
            let (mut sloss, mut sd) = (vec![0.0; n], vec![0.0; n * v]);
            nn::cross_entropy_fused(&logits, &targets, v, seed, &mut sloss, &mut sd).unwrap();
            let (gsc, gl) = (up(&s, &sc), up(&s, &logits));
            let (mut gloss, mut gd) = (s.alloc_zeros::<f32>(n).unwrap(), nan_bf16(&s, n * v));
            let at = Some(&gsc);
            launch::cross_entropy_fused(&s, &gl, &gt, v, dloss, at, &mut gloss, &mut gd).unwrap();
            same("scaled cross-entropy losses", &down(&s, &gloss), &loss);
            same_bf16("scaled cross-entropy dlogits", &s, &gd, &sd);
            let mut gl = up(&s, &logits);
            launch::cross_entropy_fused_in_place(&s, &mut gl, &gt, v, dloss, at, &mut gloss)
                .unwrap();
            same("scaled in-place cross-entropy dlogits", &down(&s, &gl), &sd);
        }
    }
}

#[test]
fn bias_grad_over_chunks_equals_its_twin() {
    let Some(s) = gpu_stream("bias_grad_over_chunks_equals_its_twin") else {
        return;
    };
    // One row; a partial chunk; several chunks with a partial tile of 32 columns.
    for (n, c) in [(1usize, 33usize), (200, 64), (600, 40), (1025, 1000)] {
        let (dy, db0) = (data(n * c, 51, 1.0), data(c, 52, 0.1));
        let mut db = db0.clone();
        nn::bias_grad(&dy, &mut db).unwrap();
        let (gdy, mut gdb) = (up(&s, &dy), up(&s, &db0));
        launch::bias_grad(&s, &gdy, &mut gdb).unwrap();
        same(&format!("bias grad {n}×{c}"), &down(&s, &gdb), &db);
    }
}

#[test]
fn embeddings_and_bias_grad_equal_their_twins() {
    let Some(s) = gpu_stream("embeddings_and_bias_grad_equal_their_twins") else {
        return;
    };
    let (vocab, c, t, seqs) = (1000usize, 96usize, 64usize, 8usize);
    let n = t * seqs;
    let mut ids: Vec<u32> = (0..n).map(|r| ((r * r * 31 + 7) % vocab) as u32).collect();
    ids[3] = vocab as u32 + 5; // out of range: a NaN row, no gradient
    let (wte, wpe) = (data(vocab * c, 41, 1.0), data((t + 2) * c, 42, 1.0));
    let mut x = vec![0.0; n * c];
    nn::embedding_forward(&ids, &wte, &wpe, t, c, &mut x).unwrap();
    let dx = data(n * c, 43, 1.0);
    let (dwte0, dwpe0, db0) = (
        data(vocab * c, 44, 0.1),
        data((t + 2) * c, 45, 0.1),
        data(c, 46, 0.1),
    );
    let (mut dwte, mut dwpe, mut db) = (dwte0.clone(), dwpe0.clone(), db0.clone());
    nn::embedding_backward_tokens(&ids, &dx, c, &mut dwte).unwrap();
    nn::embedding_backward_positions(&dx, t, c, &mut dwpe).unwrap();
    nn::bias_grad(&dx, &mut db).unwrap();

    let (gi, gte, gpe, gdx) = (up(&s, &ids), up(&s, &wte), up(&s, &wpe), up(&s, &dx));
    let mut gxo = s.alloc_zeros::<f32>(n * c).unwrap();
    launch::embedding_forward(&s, &gi, &gte, &gpe, t, c, &mut gxo).unwrap();
    same("embedding x", &down(&s, &gxo), &x);
    let (mut gte_d, mut gpe_d, mut gdb) = (up(&s, &dwte0), up(&s, &dwpe0), up(&s, &db0));
    launch::embedding_backward_tokens(&s, &gi, &gdx, c, &mut gte_d).unwrap();
    launch::embedding_backward_positions(&s, &gdx, t, c, &mut gpe_d).unwrap();
    launch::bias_grad(&s, &gdx, &mut gdb).unwrap();
    same("dwte", &down(&s, &gte_d), &dwte);
    // The grouped kernel (ids on the host; in range) gives the twin's bits too.
    ids[3] = 17;
    let mut dwte = dwte0.clone();
    nn::embedding_backward_tokens(&ids, &dx, c, &mut dwte).unwrap();
    let mut gte_g = up(&s, &dwte0);
    launch::embedding_backward_tokens_host_ids(&s, &ids, &gdx, c, &mut gte_g).unwrap();
    same("dwte (grouped)", &down(&s, &gte_g), &dwte);
    ids[5] = vocab as u32;
    let bad = launch::embedding_backward_tokens_host_ids(&s, &ids, &gdx, c, &mut gte_g);
    assert!(bad.unwrap_err().to_string().contains("not below"));
    same("dwpe", &down(&s, &gpe_d), &dwpe);
    same("dbias", &down(&s, &gdb), &db);
}

#[test]
fn bias_add_and_heads_permutations_equal_their_twins() {
    let Some(s) = gpu_stream("bias_add_and_heads_permutations_equal_their_twins") else {
        return;
    };
    // Bias add over rows (a row longer than a block of 256 threads too).
    for (n, c) in [(7usize, 96usize), (3, 1000)] {
        let (y0, b) = (data(n * c, 51, 2.0), data(c, 52, 1.0));
        let mut y = y0.clone();
        nn::bias_add(&mut y, &b).unwrap();
        let (mut gy, gb) = (up(&s, &y0), up(&s, &b));
        launch::bias_add(&s, &mut gy, &gb).unwrap();
        same("bias_add", &down(&s, &gy), &y);
    }
    // q, k, v out of qkv [b·t, 3e] and back; the heads' outputs into [b·t, e] and back.
    let (b, t, h, d) = (3usize, 37usize, 4usize, 24usize);
    let e = h * d;
    let qkv = data(b * t * 3 * e, 53, 1.0);
    let gqkv = up(&s, &qkv);
    let mut merged = data(b * t * 3 * e, 54, 1.0);
    let mut gmerged = up(&s, &merged);
    for offset in [0, e, 2 * e] {
        let l = nn::HeadsLayout {
            b,
            t,
            h,
            d,
            row: 3 * e,
            offset,
        };
        let mut heads = vec![0.0; l.heads_len()];
        nn::heads_split(&qkv, l, &mut heads).unwrap();
        let mut gh = s.alloc_zeros::<f32>(l.heads_len()).unwrap();
        launch::heads_split(&s, &gqkv, l, &mut gh).unwrap();
        same("heads_split", &down(&s, &gh), &heads);
        both_halves!("heads_split", &s, l.heads_len(), &heads, |hh| {
            launch::heads_split(&s, &gqkv, l, &mut hh)
        });
        nn::heads_merge(&heads, l, &mut merged).unwrap();
        launch::heads_merge(&s, &gh, l, &mut gmerged).unwrap();
    }
    same("heads_merge into qkv", &down(&s, &gmerged), &merged);
    same("merge of the splits", &merged, &qkv);
    let l = nn::HeadsLayout {
        b,
        t,
        h,
        d,
        row: e,
        offset: 0,
    };
    let yh = data(l.heads_len(), 55, 1.0);
    let mut y = vec![0.0; l.rows_len()];
    nn::heads_merge(&yh, l, &mut y).unwrap();
    let mut gy = s.alloc_zeros::<f32>(l.rows_len()).unwrap();
    launch::heads_merge(&s, &up(&s, &yh), l, &mut gy).unwrap();
    same("heads_merge", &down(&s, &gy), &y);
    both_halves!("heads_merge", &s, l.rows_len(), &y, |hy| {
        launch::heads_merge(&s, &up(&s, &yh), l, &mut hy)
    });
    let bad = nn::HeadsLayout { offset: 1, ..l };
    assert!(launch::heads_split(&s, &gy, bad, &mut up(&s, &yh)).is_err());
}
