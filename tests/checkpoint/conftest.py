"""Fixtures of the checkpoint tests: small real tmpfs mounts to fill up (disk-full tests)."""
import pytest
from ckpt_dist_helpers import mount_tmpfs, umount


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(name, size) -> path of a fresh tmpfs under tmp_path (root only); unmounted afterwards."""
    mounted = []

    def mount(name: str, size: str) -> str:
        path = str(tmp_path / name)
        if not mount_tmpfs(path, size):
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        umount(path)
