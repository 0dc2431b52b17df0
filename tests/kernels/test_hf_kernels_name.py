"""transformers probes for the Hugging Face `kernels` package; it must not mistake ours for it."""

from __future__ import annotations

import tomllib

from tests.kernels.subprocess_env import REPO_ROOT, run_ok

PROBE = """
import sys, torch, kernels
assert kernels.__file__.startswith({root!r}), kernels.__file__  # ours is the one on sys.path
from transformers.utils.import_utils import _is_package_available, is_kernels_available
import transformers.integrations.hub_kernels as hub_kernels
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained({model_dir!r})
model = LlamaForCausalLM.from_pretrained({model_dir!r})
logits = model(torch.tensor([[1, 5, 9, 3]])).logits
assert logits.shape == (1, 4, 64) and bool(torch.isfinite(logits).all())
print(is_kernels_available(), hasattr(hub_kernels, "get_kernel_hub"), model.use_kernels,
      sys.modules["kernels"] is kernels, _is_package_available("kernels", return_version=True)[1])
"""


def _probe(tmp_path, **env) -> list[str]:
    code = PROBE.format(root=str(REPO_ROOT), model_dir=str(tmp_path / "tiny-llama"))
    return run_ok(code, **env).split()


def _pdserve_version() -> str:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_transformers_does_not_take_our_kernels_for_the_hub_package(tmp_path):
    # With pdserve not installed, no distribution claims `kernels`: transformers imports ours and finds
    # no __version__ -> "N/A". With pdserve installed (CI: pip install -e .) it reads pdserve's version.
    probed = _probe(tmp_path)
    assert probed[:4] == ["False", "False", "False", "True"]
    assert probed[4] in ("N/A", _pdserve_version())


def test_not_mistaken_when_installed_as_the_pdserve_distribution(tmp_path):
    # An installed pdserve maps the import name `kernels` to the pdserve distribution, whose version
    # transformers then reads as the `kernels` version: it must stay outside transformers' window.
    version = _pdserve_version()
    dist_info = tmp_path / "site" / f"pdserve-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pdserve\nVersion: {version}\n")
    (dist_info / "top_level.txt").write_text("kernels\nengine\n")
    probed = _probe(tmp_path, PYTHONPATH=f"{REPO_ROOT}:{tmp_path / 'site'}")
    assert probed == ["False", "False", "False", "True", version]
