//! The head's logits in chunks of tokens (`Logits::Chunked`: each chunk's logits,
//! cross-entropy and backward before the next's) against all tokens at once (`Logits::Whole`)
//! on the host twins: the same loss and every gradient but `wte`'s bit for bit (each token's
//! row is its own products and cross-entropy), `wte`'s within the f32 rounding of summing the
//! tied head's term chunk by chunk, at chunks that divide the tokens and chunks that do not,
//! with f32 and bf16 products; and the memory it saves: one chunk's logits at a time.

mod common;

use fsdp_kernels::gpt::{DeviceGpt, GptOps, HostOps, HostProducts, Logits};

type Grads = Vec<(String, Vec<f32>)>;

/// The loss, every gradient and the step's counted peak.
fn step(
    products: HostProducts,
    logits: Logits,
    cfg: &fsdp_gpt::model::GptConfig,
) -> (f32, Grads, u64) {
    let dims = common::dims(cfg);
    let (rows, t) = (3, cfg.block_size);
    let mut model = DeviceGpt::new(
        HostOps::with_products(products),
        dims,
        &common::weights(cfg),
    )
    .unwrap();
    model.set_logits(logits);
    let inputs = common::ids(rows * t, 1, cfg.vocab_size);
    let targets = common::ids(rows * t, 2, cfg.vocab_size);
    model.ops().reset_peak();
    let loss = model.step(&inputs, &targets, rows, t).unwrap();
    (
        loss,
        model.download_grads().unwrap(),
        model.ops().memory().peak,
    )
}

#[test]
fn chunked_logits_give_the_whole_bits_but_the_tied_weights_sum() {
    // 48 tokens of a vocabulary of 200.
    let cfg = fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 200).unwrap();
    let token = 200 * 4;
    for products in [
        HostProducts::F32,
        HostProducts::Bf16Operands,
        HostProducts::F16Operands,
    ] {
        let (loss, grads, whole) = step(products, Logits::Whole, &cfg);
        for max_bytes in [1, 7 * token, 16 * token, usize::MAX] {
            let chunked = Logits::Chunked { max_bytes };
            let (l, g, peak) = step(products, chunked, &cfg);
            let what = format!("{products:?}, {chunked}");
            assert_eq!(l.to_bits(), loss.to_bits(), "{what}: the loss");
            for ((name, a), (_, b)) in g.iter().zip(&grads) {
                if name == "transformer.wte.weight" {
                    let max = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                    let diff = a
                        .iter()
                        .zip(b)
                        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(diff <= 1e-6 * max, "{what}: {name}: {diff:e} of {max:e}");
                } else {
                    assert_eq!(
                        common::bits(a),
                        common::bits(b),
                        "{what}: {name}'s gradient"
                    );
                }
            }
            assert!(peak <= whole, "{what}: peak {peak} vs {whole}");
        }
    }
    // The logits dominate (48 tokens × 4000): a chunk of 8 tokens holds a sixth of them.
    let wide = fsdp_gpt::model::GptConfig::new(1, 2, 16, 16, 4000).unwrap();
    let (_, _, whole) = step(HostProducts::F32, Logits::Whole, &wide);
    let eight = Logits::Chunked {
        max_bytes: 8 * 4000 * 4,
    };
    let (_, _, chunked) = step(HostProducts::F32, eight, &wide);
    let saved = (40 * 4000 * 4) as u64;
    assert!(
        chunked + saved <= whole,
        "chunks of 8 tokens {chunked} B, whole {whole} B"
    );
}

#[test]
fn a_chunk_is_at_least_one_token() {
    assert_eq!(
        Logits::Chunked { max_bytes: 1 }.chunk_tokens(50304, 8192),
        1
    );
    assert_eq!(Logits::default().chunk_tokens(50304, 8192), 1334);
    assert_eq!(Logits::default().chunk_tokens(64, 100), 100);
    assert_eq!(Logits::Whole.chunk_tokens(50304, 8192), 8192);
    assert_eq!("whole".parse::<Logits>(), Ok(Logits::Whole));
    assert!("halves".parse::<Logits>().is_err());
}

#[test]
fn chunks_of_a_named_size_parse() {
    use fsdp_kernels::gpt::Attention;
    let mib = |n: usize| n << 20;
    assert_eq!("chunked".parse::<Logits>(), Ok(Logits::default()));
    assert_eq!(
        "chunked:512".parse::<Logits>(),
        Ok(Logits::Chunked {
            max_bytes: mib(512)
        })
    );
    assert_eq!("chunked".parse::<Attention>(), Ok(Attention::default()));
    assert_eq!(
        "chunked:256".parse::<Attention>(),
        Ok(Attention::Chunked {
            max_bytes: mib(256)
        })
    );
    assert_eq!(
        "materialized".parse::<Attention>(),
        Ok(Attention::Materialized)
    );
    assert_eq!(
        Attention::Chunked {
            max_bytes: mib(256)
        }
        .to_string(),
        "chunked (256 MiB)"
    );
    for bad in [
        "chunked:0",
        "chunked:",
        "chunked:1.5",
        "chunked:-3",
        "chunked:99999999999999999",
    ] {
        let e = bad.parse::<Attention>().unwrap_err();
        assert!(e.contains(bad) && e.contains("MiB"), "{bad}: {e}");
        let e = bad.parse::<Logits>().unwrap_err();
        assert!(e.contains(bad) && e.contains("MiB"), "{bad}: {e}");
    }
    assert!("chunky"
        .parse::<Attention>()
        .unwrap_err()
        .contains("chunked:MiB"));
}
