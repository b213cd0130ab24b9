"""The arch capability table (cuflash/arch.py), the one source of every plan's budgets."""
from cuflash import arch
from cuflash.kernels import backward, forward, simt

KB = 1024


def test_table_is_consistent():
    for number, caps in arch.ARCHS.items():
        assert caps.arch == number
        assert caps.smem_per_block == caps.smem_per_sm - KB  # the driver reserves 1 KB per block
        assert caps.registers_per_sm == 64 * KB
        assert caps.has_cp_async and caps.has_wgmma == (number == 90)
    assert arch.arch_caps(80).smem_per_block == 163 * KB
    assert arch.arch_caps(86).smem_per_block == arch.arch_caps(89).smem_per_block == 99 * KB
    assert arch.arch_caps(90).smem_per_block == arch.arch_caps(100).smem_per_block == 227 * KB


def test_unknown_arch_is_conservative():
    assert arch.arch_caps(130).smem_per_block == arch.min_smem_per_block() == 99 * KB
    assert not arch.arch_caps(130).has_wgmma and arch.arch_caps(130).has_cp_async
    assert not arch.arch_caps(75).has_cp_async


def test_every_plan_module_reads_the_table():
    assert simt.MAX_SMEM_BYTES == arch.min_smem_per_block()
    for number in (80, 86, 90, 100, 110, 120):
        limit = arch.arch_caps(number).smem_per_block
        for module in (forward, backward, simt):
            variants = module.all_variants(number)
            assert variants and all(v.smem_bytes <= limit for v in variants), (module.__name__, number)
        wgmma = [v for v in forward.all_variants(number) + backward.all_variants(number)
                 if getattr(v.config, "wgmma", False)]
        assert bool(wgmma) == (number == 90)
    for module in (forward, backward, simt):
        assert module.all_variants(75) == []
