"""Weights read block by block into their shards: `to_sharded` with a reader, `checkpoint.hf_reader`,
and `train.build_model(init_from=...)`, which never holds the whole model on the host."""
import pytest
import torch
import torch_xla
from util import hf_model

from llama_xla_helpers import checkpoint
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.sharding import axis_size, shard_activations, shard_params, to_sharded
from llama_xla_helpers.train import build_model

CONFIG = get_config("tiny", num_hidden_layers=2)


@pytest.fixture(scope="module")
def mesh(runtime):
    return make_mesh((4, 2))


@pytest.fixture(scope="module")
def exported(mesh, tmp_path_factory):
    """A sharded model's weights as a Hugging Face folder (export_hf), and the folder."""
    model = hf_model(CONFIG, seed=3)
    shard_params(model, mesh, "2d")
    folder = checkpoint.export_hf(model, tmp_path_factory.mktemp("hf"))
    return {n: p.detach().cpu() for n, p in model.named_parameters()}, folder


def block(index):
    return tuple((s.start, s.stop) for s in index)


def test_to_sharded_from_a_reader_reads_each_block_once(mesh):
    cpu = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    for spec in [("data", "model"), ("model", None), (None, None)]:
        asked = []

        def read(index):
            asked.append(block(index))
            return cpu[index]
        t = to_sharded(read, mesh, spec, shape=cpu.shape)
        assert torch.equal(t.cpu(), cpu) and torch.equal(to_sharded(cpu, mesh, spec).cpu(), cpu)
        splits = [1 if a is None else axis_size(mesh, a) for a in spec]
        assert len(asked) == len(set(asked)) == splits[0] * splits[1], spec  # replicas share one read
        assert all(b - a == n // k for index in asked for (a, b), n, k in zip(index, cpu.shape, splits)), asked
        assert torch_xla._XLAC._get_xla_sharding_spec(t) == torch_xla._XLAC._get_xla_sharding_spec(
            to_sharded(cpu, mesh, spec))
    read.shape = cpu.shape  # a reader may carry its shape
    assert torch.equal(to_sharded(read, mesh, (None, None)).cpu(), cpu)
    with pytest.raises(ValueError, match=r"returned shape \(8, 6\), not the block's \(2, 3\)"):
        to_sharded(lambda index: cpu, mesh, ("data", "model"), shape=cpu.shape)


def test_build_model_init_from_reads_only_blocks_and_matches_load_hf(mesh, exported, monkeypatch):
    weights, folder = exported
    asked = {}
    real_reader = checkpoint.hf_reader

    def recording_reader(path, dtype=torch.float32):  # hf_reader, noting every block asked for
        init = real_reader(path, dtype)

        def recording_init(name, shape):
            read = init(name, shape)

            def recorded(index):
                asked.setdefault(name, []).append(block(index))
                return read(index)
            recorded.shape = read.shape
            return recorded
        return recording_init

    monkeypatch.setattr(checkpoint, "hf_reader", recording_reader)
    streamed = build_model(CONFIG, mesh, init_from=str(folder))
    assert asked.keys() == weights.keys()
    for name, blocks in asked.items():
        splits = [1 if a is None else axis_size(mesh, a) for a in streamed.partition_specs[name]]
        shape = weights[name].shape
        # One read per distinct block: a tensor sharded k ways is asked for k blocks of 1/k of it
        # (a (4, 2) split: 8 blocks, never the whole); a replicated norm once, whole.
        assert len(blocks) == len(set(blocks)) == torch.Size(splits).numel(), name
        assert all(b - a == n // k for index in blocks for (a, b), n, k in zip(index, shape, splits)), name

    old = checkpoint.load_hf(folder)  # the old path: the whole model on the host, then sharded
    shard_params(old, mesh, "2d")
    shard_activations(old, mesh)
    for name, p in streamed.named_parameters():
        assert torch.equal(p.detach().cpu(), weights[name]), name
        assert torch_xla._XLAC._get_xla_sharding_spec(p) == torch_xla._XLAC._get_xla_sharding_spec(
            old.get_parameter(name)), name
    ids = torch.randint(0, CONFIG.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(torch_xla.device())
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits.cpu(), old(ids).logits.cpu())

    bf16 = build_model(CONFIG, mesh, init_from=str(folder), dtype=torch.bfloat16)
    for name, p in bf16.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach().cpu(), weights[name].to(torch.bfloat16)), name


def test_init_from_another_config_or_no_safetensors_says_what_to_do(mesh, exported, tmp_path):
    _, folder = exported
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(384, 128\) in .*"
                                         r"model\.safetensors but the model expects \(256, 128\); build the model "
                                         r"from .*config\.json"):
        build_model(get_config("tiny", num_hidden_layers=2, intermediate_size=256), mesh, init_from=str(folder))
    with pytest.raises(ValueError, match=r"has no tensor 'model\.layers\.2\.self_attn\.q_proj\.weight' \(the model "
                                         r"expects shape \(128, 128\)\)"):
        build_model(get_config("tiny", num_hidden_layers=3), mesh, init_from=str(folder))
    (tmp_path / "pytorch_model.bin").touch()
    with pytest.raises(ValueError, match=r"has no \*\.safetensors file .*save_pretrained"):
        build_model(CONFIG, mesh, init_from=str(tmp_path))
