"""The trainer reads prepared token stores and never builds one where it must not: in a
bucket, or when its processes span machines (each host would tokenise the whole corpus)."""
import pytest

from pretrain.data import DataError, pipeline, tasks
from sharding.distributed import is_loopback


def _pipeline(tmp_path, **kwargs):
  if not (tmp_path / "corpus").exists():  # once: the store's key covers the files
    (tmp_path / "corpus").mkdir()
    for i in range(6):
      (tmp_path / "corpus" / f"doc{i}.txt").write_text(f"document {i} " * 40)
  task = tasks.text_files_task(train_files=f"{tmp_path}/corpus/*.txt",
                               validation_fraction=0.25)
  return pipeline.DataPipeline(task=task, sequence_length=32, batch_size=4, **kwargs)


def test_multi_host_run_without_a_prepared_store_names_the_prepare_command(tmp_path):
  cache = str(tmp_path / "cache")
  with pytest.raises(DataError) as caught:
    _pipeline(tmp_path, process_index=1, process_count=2, cache_dir=cache,
              build_missing=False)
  message = str(caught.value).splitlines()[0]  # Gin appends where it was raised
  assert "a multi-host run does not build one" in message
  assert f"python -m pretrain.data.prepare --gin_file=<this run's gin files> " \
         f"--output={cache}" in message
  assert not (tmp_path / "cache").exists()  # nothing built, nothing half-written

  # Once the store exists (built on one machine here), every process opens it.
  built = _pipeline(tmp_path, cache_dir=cache)
  host = _pipeline(tmp_path, process_index=1, process_count=2, cache_dir=cache,
                   build_missing=False)
  assert host.train_store.path == built.train_store.path
  assert host.num_train_rows == built.num_train_rows
  for step in (0, 3):  # process 1 reads rows 2:4 of the global batch, and only those
    assert (host.batch(step)["targets"] == built.batch(step)["targets"][2:]).all()


def test_bucket_cache_is_never_built_into(tmp_path, s3_bucket):
  url = f"{s3_bucket}/tokens"
  with pytest.raises(DataError, match=r"object storage does not build one: prepare it "
                     rf"first with `python -m pretrain.data.prepare .* --output={url}`"):
    _pipeline(tmp_path, cache_dir=url)


def test_loopback_coordinators_are_one_machine():
  for address in ("127.0.0.1:1234", "localhost:80", "[::1]:8476"):
    assert is_loopback(address), address
  for address in ("10.0.0.2:8476", "tpu-worker-0:8476", ""):
    assert not is_loopback(address), address
