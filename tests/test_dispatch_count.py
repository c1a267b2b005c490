"""usaf.testing.dispatch: which operators make the host wait for a device (meta tensors stand in for one here)."""

from __future__ import annotations

import torch

from usaf.backends.transfer import upload
from usaf.testing.dispatch import count_dispatch, waits_for_device

META = torch.device("meta")


def test_blocking_copies_scalar_reads_and_data_sized_outputs_wait_for_the_device():
    host, device = torch.ones(2), torch.empty(2, device=META)
    assert waits_for_device("_to_copy.default", (host,), {"device": META}, device) == "copy to the device"
    assert waits_for_device("_to_copy.default", (device,), {"device": torch.device("cpu")}, host) == "copy to the host"
    assert waits_for_device("copy_.default", (device, host), {}, device) == "copy to the device"
    assert waits_for_device("copy_.default", (host, device), {}, host) == "copy to the host"
    assert waits_for_device("_local_scalar_dense.default", (device,), {}, 1.0) == "scalar read"
    assert waits_for_device("nonzero.default", (device,), {}, device) == "sized by the data"
    # non-blocking from pageable memory waits too (only pinned memory, which needs a GPU here, makes it not wait)
    assert waits_for_device("_to_copy.default", (host,), {"device": META, "non_blocking": True}, device) is not None
    assert waits_for_device("copy_.default", (device, host, True), {}, device) == "copy to the device"
    # what does not wait: a copy within one memory, host-only work, an ordinary device op
    assert waits_for_device("_to_copy.default", (host,), {"dtype": torch.int32}, host.int()) is None
    assert waits_for_device("copy_.default", (device, device), {}, device) is None
    assert waits_for_device("_local_scalar_dense.default", (host,), {}, 1.0) is None
    assert waits_for_device("nonzero.default", (host,), {}, host) is None
    assert waits_for_device("add.Tensor", (device, device), {}, device) is None


def test_the_count_sees_what_runs():
    count = count_dispatch(lambda: (torch.ones(3).to(META), torch.ones(3).to(META, non_blocking=True), torch.ones(2)))
    assert count.ops >= 5 and count.syncs == 2 and count.waiting == {"copy to the device": 2}
    assert count_dispatch(lambda: torch.ones(3).sum().item()).syncs == 0  # on the host nothing waits


def test_upload_on_the_host_and_where_nothing_is_pinned_is_a_plain_copy():
    host = torch.arange(5)
    assert upload(host, "cpu") is host  # nothing to move
    moved = upload(host, META)  # meta has no pinned memory: a plain copy
    assert moved.device == META and moved.shape == host.shape and moved.dtype == host.dtype
