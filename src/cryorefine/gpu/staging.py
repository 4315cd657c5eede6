"""Uploads that overlap the GPU's work: two device buffers filled in turn on a stream of their own.

`ParticleSet.read_ahead` reads the next batch's images on a thread while the current batch is worked
on. With `UploadSlots` that thread also copies them to the device, into the slot the batch before last
used, on a side stream: the copy waits on the GPU for the work that read that slot (`release`,
recorded on the caller's stream when the caller moves on), and the caller's stream waits on the GPU
for the copy (`take`). No host thread waits for the other's GPU work, except the reading thread for the
copy out of the page-locked host buffer it is about to refill (long finished by then).

The slots are allocated once, on the caller's thread (the device arena is a stack: nothing may be
allocated from another thread), and let go with the object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cryorefine.gpu import DeviceArray

if TYPE_CHECKING:  # for annotations only
    import numpy as np
    import numpy.typing as npt


class UploadSlots:
    """Two device buffers of `n_images` images of `image_shape` and `dtype`, on the current device."""

    def __init__(self, n_images: int, image_shape: tuple[int, ...], dtype: npt.DTypeLike) -> None:
        import cupy

        self.cp = cupy
        self.device_id = cupy.cuda.Device().id
        self.slots = [cupy.empty((int(n_images), *image_shape), dtype=dtype) for _ in range(2)]
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.uploaded: list[Any] = [None, None]  # the event after each slot's last copy (cupy.cuda.Event)
        self.released = [None, None]  # the event after the caller's last use of each slot

    @staticmethod
    def nbytes(n_images: int, image_shape: tuple[int, ...], itemsize: int) -> int:
        """Device bytes of the two slots."""
        n = int(n_images) * int(itemsize)
        for size in image_shape:
            n *= int(size)
        return 2 * n

    def holds(self, slot: int, n_images: int) -> bool:
        """Whether `slot` has room for a batch of `n_images`."""
        return self.slots[slot].shape[0] >= n_images

    def wait_uploaded(self, slot: int) -> None:
        """On the reading thread, before it refills the host buffer of `slot`: the last copy out of it has ended."""
        uploaded = self.uploaded[slot]
        if uploaded is not None:
            uploaded.synchronize()

    def upload(self, slot: int, host_images: np.ndarray) -> DeviceArray:
        """On the reading thread: copy `host_images` (page-locked) into `slot` once the caller has let it go; returns
        the device view. The copy is queued, not finished: `take` makes the caller's stream wait for it."""
        cp = self.cp
        n = host_images.shape[0]
        with cp.cuda.Device(self.device_id):
            if self.released[slot] is not None:
                self.stream.wait_event(self.released[slot])
            view = self.slots[slot][:n]
            view.set(host_images, stream=self.stream)
            self.uploaded[slot] = self.stream.record()
        return view

    def take(self, slot: int) -> None:
        """On the caller's thread: its stream waits (on the GPU) for the copy into `slot`."""
        self.cp.cuda.get_current_stream().wait_event(self.uploaded[slot])

    def release(self, slot: int) -> None:
        """On the caller's thread, once it has queued all its work on `slot`: the next copy into it waits for that."""
        self.released[slot] = self.cp.cuda.get_current_stream().record()
