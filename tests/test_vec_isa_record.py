"""aot_package.known_vec_isa: inductor's vector-ISA probe (a compile and a child Python per ISA) runs in
the first process on a host; later processes take the recorded answer, and probe again where it differs."""
import platform

import pytest
from torch._inductor import cpp_builder, cpu_vec_isa

from service.engine import aot_package

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")


def _new_process():
    """What a new process starts with: no answers cached (the base probe's and each ISA's own checks)."""
    aot_package.known_vec_isa.cache_clear()
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()
    for cls in (cpu_vec_isa.VecAVX512, cpu_vec_isa.VecAVX512VNNI, cpu_vec_isa.VecAMX):
        cls.__bool__.cache_clear()


@pytest.fixture
def base_probes(monkeypatch):
    """The ISAs whose base test inductor compiles and loads (its own extra checks not counted)."""
    calls = []
    real = cpu_vec_isa.VecISA.check_build

    def counted(self, code):
        if code == cpu_vec_isa.VecISA._avx_code:
            calls.append(str(self))
        return real(self, code)

    _new_process()
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", counted)
    yield calls
    _new_process()


def _listed():
    return [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]


def test_the_first_process_probes_and_records_later_ones_do_not(tmp_path, base_probes):
    aot_package.known_vec_isa(tmp_path)
    listed = _listed()
    if not listed:
        pytest.skip("this CPU lists no vector ISA inductor knows: nothing to probe")
    assert (tmp_path / "vec-isa.txt").read_text().splitlines()[2:] == listed
    assert base_probes  # probed here
    base_probes.clear()
    _new_process()
    aot_package.known_vec_isa(tmp_path)
    assert base_probes == []
    assert _listed() == listed and str(cpu_vec_isa.pick_vec_isa()) in listed


def test_a_record_that_differs_is_probed_again(tmp_path, base_probes):
    aot_package.known_vec_isa(tmp_path)
    lines = (tmp_path / "vec-isa.txt").read_text().splitlines()
    if len(lines) < 3:
        pytest.skip("this CPU lists no vector ISA inductor knows: nothing to probe")
    (tmp_path / "vec-isa.txt").write_text("\n".join(lines[:-1]))  # as if one ISA had failed its probe
    base_probes.clear()
    _new_process()
    aot_package.known_vec_isa(tmp_path)
    assert sorted(base_probes) == sorted(lines[2:])  # each listed ISA probed for real, none taken on trust
    assert (tmp_path / "vec-isa.txt").read_text().splitlines() == lines  # and recorded anew


def test_without_a_compiler_or_a_writable_folder_packages_still_load(tmp_path, base_probes, monkeypatch):
    def no_compiler(*_):
        raise RuntimeError("no C++ compiler")

    with monkeypatch.context() as m:
        m.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
        aot_package.known_vec_isa(tmp_path)  # no record, no error: inductor probes where it needs to
    assert not (tmp_path / "vec-isa.txt").exists() and base_probes == []
    _new_process()
    aot_package.known_vec_isa(tmp_path / "missing")  # the record cannot be written
    assert not (tmp_path / "missing").exists()
