import pytest
import torch

from pdserve.engine.cpu_threads import one_cpu_thread


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_cpu_copies_run_on_one_thread_then_the_count_is_restored(two_threads):
    with one_cpu_thread(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_restored_after_an_error(two_threads):
    with pytest.raises(RuntimeError), one_cpu_thread(torch.device("cpu")):
        raise RuntimeError("copy failed")
    assert torch.get_num_threads() == 2


def test_other_devices_keep_every_thread(two_threads):
    with one_cpu_thread(torch.device("cuda")):  # the copy runs on the GPU: host threads untouched
        assert torch.get_num_threads() == 2
