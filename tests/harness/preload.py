"""What every training process imports, loaded once in the test harness's fork server (tests/harness/launcher.py).

Imported there and nowhere else: a rank forked from that server finds these modules in
``sys.modules`` and starts at once. Nothing here may compute with torch or start a thread: a
fork of a process with a running OpenMP pool or CUDA context can hang or fail.
"""

import gc

import torch  # noqa: F401
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.format_utils  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401
import torch.distributed.fsdp.wrap  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.nn.parallel  # noqa: F401
import torchvision.datasets  # noqa: F401
import torchvision.transforms  # noqa: F401

try:  # the copies of tests/test_hugging_face.py build their models with it; the floor pass has no transformers
    import safetensors.torch  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
except ImportError:
    pass

import common.bookkeeping  # noqa: F401
import common.checkpoint  # noqa: F401
import common.cli  # noqa: F401
import common.data  # noqa: F401
import common.flag_checks  # noqa: F401
import common.models  # noqa: F401
import common.tokens  # noqa: F401
import common.training  # noqa: F401  # noqa: F401  # noqa: F401
import tools.runs.export_checkpoint  # noqa: F401

# Every rank is a fork of this process and shares its memory until it writes to it. Python's garbage
# collector writes to every object it examines, so each rank's first full collection copied the pages
# of all the objects imported above. Frozen, the collector leaves them alone: measured, a fifth less
# CPU for the warm runs of test_equivalence.py's transformer cases (47 s -> 37-39 s, twice each).
gc.freeze()
