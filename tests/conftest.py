import os

from inflight import omp

omp.apply()  # before torch loads

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels run in the interpreter on machines without a GPU; it must be set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    from inflight.demo_model import write_demo_model

    return str(write_demo_model(tmp_path_factory.mktemp("demo_model")))


@pytest.fixture(scope="session")
def hf_model(demo_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(demo_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(demo_model_dir)
