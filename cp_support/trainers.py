"""What tests and benchmarks share to run transformers' and TRL's trainers on CPU: FSDP2 as a GPU
run selects it, its TrainingArguments, and the LoRA targets of the tiny models."""


class FSDP2OnCPU:
    """On CPU only: accelerate selects FSDP for accelerator devices alone (its `AcceleratorState`),
    so on CPU `TrainingArguments(fsdp=...)` silently runs DDP. After the trainer made its
    accelerator, this sets accelerate's state to FSDP2 with the arguments' plugin, as a GPU run
    has it; FSDP2 itself runs on gloo. Set again when the trainer's `__init__` ends: GRPO's seeding
    (`set_seed(device_specific=True)`) makes an AcceleratorState, which copies the process state's
    MULTI_CPU over it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._as_fsdp2()

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self._as_fsdp2()

    def _as_fsdp2(self):
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if state.distributed_type != DistributedType.FSDP:
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
        self.is_fsdp_enabled = True


# checkpoints as FSDP2 shards (pytorch_model_fsdp_0/): saving the whole model (FULL_STATE_DICT)
# fails on gloo here, with or without CP, in transformers' save_pretrained of the gathered state
FSDP2 = {"fsdp": True, "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the tiny models' attention projections
