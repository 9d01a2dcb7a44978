"""aot_package.known_vec_isa: inductor's vector-ISA probe (a compile and a child Python per ISA) runs in
the first process on a host; later processes take the recorded answer, and probe again where it differs."""
import pytest
from torch._inductor import cpu_vec_isa

from service.engine import aot_package


def _new_process():
    """What a new process starts with: no answers cached."""
    aot_package.known_vec_isa.cache_clear()
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()


@pytest.fixture
def probes(monkeypatch):
    """Counts the ISA probes; inductor's caches cleared before and after (they are per process)."""
    calls = []
    real = cpu_vec_isa.VecISA.check_build

    def counted(self, code):
        calls.append(str(self))
        return real(self, code)

    _new_process()
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", counted)
    yield calls
    _new_process()


def test_the_first_process_probes_and_records_later_ones_do_not(tmp_path, probes):
    aot_package.known_vec_isa(tmp_path)
    listed = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]
    record = (tmp_path / "vec-isa.txt").read_text().splitlines()
    assert record[1:] == listed
    if not listed:
        pytest.skip("this CPU lists no vector ISA inductor knows: nothing to probe")
    assert probes  # probed here
    probes.clear()
    _new_process()
    aot_package.known_vec_isa(tmp_path)
    assert probes == []
    assert [str(i) for i in cpu_vec_isa.valid_vec_isa_list()] == listed
    assert str(cpu_vec_isa.pick_vec_isa()) in listed


def test_a_record_that_differs_is_probed_again(tmp_path, probes):
    aot_package.known_vec_isa(tmp_path)
    listed = (tmp_path / "vec-isa.txt").read_text().splitlines()
    if len(listed) < 2:
        pytest.skip("this CPU lists no vector ISA inductor knows: nothing to probe")
    (tmp_path / "vec-isa.txt").write_text("\n".join([listed[0], *listed[2:]]))  # as if one ISA failed its probe
    probes.clear()
    _new_process()
    aot_package.known_vec_isa(tmp_path)
    assert probes  # the CPU's list did not match the record: probed as inductor does
    assert (tmp_path / "vec-isa.txt").read_text().splitlines() == listed  # and recorded anew


def test_without_a_compiler_or_a_writable_folder_packages_still_load(tmp_path, probes, monkeypatch):
    from torch._inductor import cpp_builder

    def no_compiler(*_):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    aot_package.known_vec_isa(tmp_path)  # no record, no error: inductor probes where it needs to
    assert not (tmp_path / "vec-isa.txt").exists() and probes == []
    monkeypatch.undo()
    _new_process()
    aot_package.known_vec_isa(tmp_path / "missing")  # the record cannot be written
    assert not (tmp_path / "missing").exists()
