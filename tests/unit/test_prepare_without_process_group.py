import pytest
import torch
import torch.distributed as dist

import commsched


def test_prepare_without_process_group_says_how_to_start_one():
    assert not dist.is_initialized()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"torchrun --nproc-per-node N.*init_process_group\(\)"):
        commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not isinstance(model, commsched.CommschedModule)
