"""Real KV reuse across serving instances with a Hugging Face transformer on the CPU.

How: examples/kv_reuse.py runs as it would for a user, with a smaller model: a LocalCluster
master, instance A (its own process and embedded segment) prefills a prompt and stores its KV
cache page by page, instance B (another process, another segment, reading over TCP) loads the
prefix pages and computes only the new turn; its next-token logits must match a full
recompute. A second test, in one process, checks that a prompt diverging mid-way reuses exactly
the pages before the divergence. Skipped without torch and transformers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch==2.13.0 (pip install -e '.[integrations]')")
pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[integrations]')")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kv_reuse.py"
SMALL = ["--prompt-tokens=256", "--turn-tokens=24", "--page-tokens=32", "--layers=2",
         "--hidden=128", "--heads=4", "--vocab=512"]  # fmt: skip


def load_example():
    spec = importlib.util.spec_from_file_location("kv_reuse_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_instance_b_reuses_instance_a_pages_across_processes_and_nodes():
    example = load_example()
    results = example.run_demo(example.parse_args(SMALL))
    a, b = results["a"], results["b"]
    assert results["pids"][0] != results["pids"][1]
    assert a["pages_saved"] == a["page_count"] == 256 // 32
    assert len(a["segments"]) == 1  # A's own segment was the only one when it wrote
    assert b["cached_tokens"] == 256 and b["computed_tokens"] == 24
    assert b["replica_segments"] == a["segments"]  # B read every page from A's node
    assert set(b["segments"]) - set(a["segments"])  # ... while contributing a segment of its own
    assert b["allclose"], b["max_abs_diff"]
    assert b["same_next_token"]


def test_a_divergent_prompt_reuses_only_the_common_pages(make_cluster):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvpool import Store
    from kvpool.integrations.transformers_cache import PageLayout, load_pages, save_pages

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    layout = PageLayout.from_config("divergence-test", config, 16, torch.float32)
    prompt = torch.randint(0, 300, (150,)).tolist()  # 9 full pages and 6 tokens
    other = prompt[:100] + [(t + 1) % 300 for t in prompt[100:]]  # diverges inside page 6
    cluster = make_cluster(1, "16MiB")
    with Store(cluster.master_endpoint) as store:
        with torch.no_grad():
            cache = model(torch.tensor([prompt]), use_cache=True).cache
            assert save_pages(store, layout, cache, prompt) == [0] * 9
            assert save_pages(store, layout, cache, prompt) == [0] * 9  # present already: success
            loaded, cached_tokens = load_pages(store, layout, other)
            assert cached_tokens == 96  # pages 0..5; page 6 holds token 100
            reused = model(torch.tensor([other[96:]]), cache=loaded, use_cache=True).logits[0, -1]
            full = model(torch.tensor([other])).logits[0, -1]
        assert torch.allclose(reused, full, atol=1e-4, rtol=1e-4)
        assert load_pages(store, layout, [1, 2, 3]) == (None, 0)  # shorter than a page
        store.remove_all(force=True)
        assert load_pages(store, layout, prompt) == (None, 0)
