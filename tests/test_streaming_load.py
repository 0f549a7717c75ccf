"""Weights read block by block into their shards: `to_sharded` with a reader, `checkpoint.hf_reader`,
`train.build_model(init_from=...)` and `parallel.load_for_inference`, which never hold the whole
model on the host."""
import pytest
import torch
import torch_xla
from torch.utils.data import TensorDataset
from util import hf_model

from llama_xla_helpers import checkpoint, parallel, sharding
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.generate import Generator
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.model import Llama
from llama_xla_helpers.sharding import axis_size, shard_activations, shard_params, to_sharded
from llama_xla_helpers.train import Adafactor, build_model, train_step

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

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


def recording(hf_reader, asked):
    """`hf_reader`, noting in asked[name] every block read of each tensor."""
    def reader(path, dtype=None):
        init = hf_reader(path, dtype)

        def recording_init(name, shape):
            read = init(name, shape)

            def recorded(index):
                asked.setdefault(name, []).append(block(index))
                return read(index)
            recorded.shape = read.shape
            return recorded
        return recording_init
    return reader


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
    monkeypatch.setattr(checkpoint, "hf_reader", recording(checkpoint.hf_reader, asked))
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


@pytest.mark.parametrize("tied", [False, True])
def test_load_for_inference_reads_only_blocks_and_matches_from_pretrained(tmp_path, monkeypatch, tied):
    config = get_config("tiny", num_hidden_layers=2, num_key_value_heads=8, tie_word_embeddings=tied)
    hf = hf_model(config, seed=4)
    hf.save_pretrained(tmp_path)  # a tied model's file holds the shared weight once, as embed_tokens
    asked = {}
    monkeypatch.setattr(parallel, "hf_reader", recording(parallel.hf_reader, asked))
    tp = make_mesh((1, 8), ("data", "model"))
    streamed = parallel.load_for_inference(tmp_path, tp, max_batch_size=2, max_seq_len=32)
    assert asked.keys() == {n for n in hf.state_dict() if not (tied and n == "lm_head.weight")}
    for name, blocks in asked.items():  # 8 distinct eighths of a weight split on 'model', a norm once
        splits = 8 if hf.get_parameter(name).dim() == 2 else 1
        assert len(blocks) == len(set(blocks)) == splits, name
    assert (streamed.lm_head.weight is streamed.embed_tokens.weight) == tied

    old = parallel.shard_for_inference(Llama.from_pretrained(tmp_path, max_batch_size=2, max_seq_len=32), tp)
    for name, t in old.state_dict().items():
        other = streamed.state_dict()[name]
        assert torch.equal(other.cpu(), t.cpu()), name
        assert torch_xla._XLAC._get_xla_sharding_spec(other) == torch_xla._XLAC._get_xla_sharding_spec(t), name
    prompts = [[5, 9, 2, 7], [11, 3, 3, 250, 17, 1]]
    assert Generator(streamed, buckets=(8,)).generate(prompts, 6)[0] == Generator(old, buckets=(8,)).generate(
        prompts, 6)[0]


def test_tied_embeddings_train_as_one_sharded_tensor(mesh, tmp_path):
    """A tied model (Llama 3.2 1B / 3B) sharded for training: embed_tokens and lm_head stay one
    tensor, read once from a folder that stores it once, and two training steps equal the CPU's."""
    config = get_config("tiny", num_hidden_layers=2, tie_word_embeddings=True)
    cpu = hf_model(get_config("tiny", num_hidden_layers=2, tie_word_embeddings=True), seed=5)  # own config:
    # shard_activations sets the sharded model's config to its attention function
    cpu.save_pretrained(tmp_path)
    model = build_model(config, mesh, init_from=str(tmp_path))
    shard_activations(model, mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "xla"
    ids = torch.randint(0, config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    opt, cpu_opt = Adafactor(model.parameters()), Adafactor(cpu.parameters())
    for _ in range(2):  # the shared weight's gradient sums both uses
        loss = train_step(model, opt, ids.to(torch_xla.device()))
        torch_xla.sync()
        assert torch.allclose(loss.cpu(), train_step(cpu, cpu_opt, ids), atol=1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.allclose(model.lm_head.weight.cpu(), cpu.lm_head.weight, atol=1e-5)


def test_loader_reads_only_the_rows_of_each_block(mesh, monkeypatch):
    """Each batch is read block by block (on a pod: only this host's rows), and equals the CPU batch
    in the sampler's order, sharded on 'data'."""
    ids = torch.arange(20 * 6).view(20, 6)
    read_shapes = []
    real = sharding.to_sharded

    def recording(source, mesh, spec, shape=None):
        def read(index):
            block = source(index)
            read_shapes.append(tuple(block.shape))
            return block
        return real(read, mesh, spec, shape)

    monkeypatch.setattr(sharding, "to_sharded", recording)
    order = [3, 17, 0, 9, 12, 5, 8, 1, 19, 2, 4, 6, 7, 10, 11, 13]
    batches = list(sharding.sharded_loader(TensorDataset(ids), 8, mesh, sampler=order))
    data = axis_size(mesh, "data")
    assert read_shapes == [(8 // data, 6)] * (2 * data)  # per batch: one read per 'data' block, never the batch
    for (batch,), rows in zip(batches, (order[:8], order[8:])):
        assert torch.equal(batch.cpu(), ids[rows])
        assert torch_xla._XLAC._get_xla_sharding_spec(batch) == torch_xla._XLAC._get_xla_sharding_spec(
            to_sharded(ids[rows], mesh, ("data", None)))
