//! `MetaOps` (allocation and counting without computation) against the host twins: the GPT's
//! step over each allocates the same buffers in the same order, so the counted memory — live
//! bytes after each step and the peak — is equal to the byte, with f32 and bf16 products
//! (whose kept operand copies grow and are refilled as the twins' are) and with activation
//! checkpointing, the attention's probabilities kept or computed again in chunks; and its
//! memory history has the same sizes in the same order.

mod common;

use fsdp_kernels::gpt::{Attention, DeviceGpt, GptOps, HostOps, HostProducts, MetaOps};

#[test]
fn meta_ops_count_what_the_host_twins_count() {
    let cfg = fsdp_gpt::model::GptConfig::new(2, 2, 32, 16, 64).unwrap();
    let dims = common::dims(&cfg);
    let params = common::weights(&cfg);
    let (rows, t) = (3, cfg.block_size);
    let inputs = common::ids(rows * t, 1, cfg.vocab_size);
    let targets = common::ids(rows * t, 2, cfg.vocab_size);
    let chunked = Attention::Chunked {
        max_bytes: 4 * t * t * 4,
    };
    let modes = [
        (HostProducts::F32, false, Attention::default()),
        (HostProducts::F32, true, Attention::Materialized),
        (HostProducts::Bf16Operands, false, chunked),
        (HostProducts::Bf16Operands, true, Attention::default()),
        (HostProducts::Bf16Operands, false, Attention::Materialized),
        (HostProducts::F16Operands, false, chunked),
        (HostProducts::Bf16Operands, false, Attention::Fused),
        (HostProducts::F16Operands, true, Attention::Fused),
    ];
    for (products, ckpt, attention) in modes {
        {
            let mut host = DeviceGpt::new(HostOps::with_products(products), dims, &params).unwrap();
            let mut meta = DeviceGpt::new(MetaOps::new(products), dims, &params).unwrap();
            host.set_activation_checkpointing(ckpt);
            meta.set_activation_checkpointing(ckpt);
            host.set_attention(attention);
            meta.set_attention(attention);
            host.ops().record_memory_history(true);
            meta.ops().record_memory_history(true);
            for _ in 0..2 {
                host.step(&inputs, &targets, rows, t).unwrap();
                meta.step(&inputs, &targets, rows, t).unwrap();
                assert_eq!(
                    host.ops().memory(),
                    meta.ops().memory(),
                    "{products:?}, {ckpt}, {attention:?}"
                );
            }
            let sizes = |h: Vec<fsdp_kernels::gpt::MemoryEvent>| -> Vec<(bool, u64)> {
                h.into_iter().map(|e| (e.alloc, e.bytes)).collect()
            };
            let (h, m) = (
                sizes(host.ops().memory_history()),
                sizes(meta.ops().memory_history()),
            );
            assert!(!h.is_empty());
            assert_eq!(h, m, "{products:?}, checkpointing {ckpt}: the histories");
        }
    }
}
