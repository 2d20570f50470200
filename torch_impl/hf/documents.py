"""Whether a model isolates packed documents in one process: the rule CP must follow.

transformers isolates the documents of a packed row (position_ids restarting, no attention_mask, no
cache) only where the model hands its mask functions (`create_causal_mask`, ...) the position_ids:
Llama, Mistral, Gemma, LFM2, DeepSeek V3.2 and GLM-5 do; GPT-OSS (and Bloom, Falcon, MPT, ...) do
not, and in one process their tokens attend across documents. A rank cannot tell from its own mask
call (transformers looks for restarts in the rank's own positions, which a shard inside one document
does not have), and every rank must decide alike (the decision picks each layer's transport), so it
is looked up in `ISOLATES`, by the class of the module that receives the inputs (its base model or
language model), or given to `parallelize(isolate_documents=...)`. A class outside the table (a new
family) gets packed rows refused until it is added: `make models` runs every family's packed rows
against one process, so a wrong entry shows there as a wrong family.
"""

_ISOLATING = """
    AXK1Model AXK2Model ApertusModel ArceeModel AriaTextModel BailingHybridModel BambaModel
    BeamModel BitNetModel BltModel CTRLModel CodeGenModel Cohere2Model Cohere2MoeModel
    CohereCompassTextModel CohereModel CwmModel DbrxModel DeepseekV2Model DeepseekV32Model
    DeepseekV3Model DeepseekV4Model DiffLlamaModel DogeModel Dots1Model Dots3NoteTextModel
    Emu3TextModel Ernie4_5Model Ernie4_5_MoeModel Exaone4Model ExaoneMoeModel FalconH1Model
    FlexOlmoModel FlintModel GPT2Model GPTBigCodeModel GPTJModel GPTNeoModel
    GPTNeoXJapaneseModel GPTNeoXModel Gemma2Model Gemma3Model Gemma3TextModel Gemma3nTextModel
    Gemma4Model Gemma4TextModel Gemma4UnifiedModel Gemma4UnifiedTextModel GemmaModel Glm4Model
    Glm4MoeLiteModel Glm4MoeModel GlmModel GlmMoeDsaModel GraniteModel GraniteMoeModel
    GraniteMoeSWAModel GraniteMoeSharedModel GraniteSWAModel HYV3Model HYV4Model HeliumModel
    HrmTextModel HunYuanDenseV1Model HunYuanMoEV1Model HyperCLOVAXModel Inkling2TextModel
    InklingTextModel Jais2Model JambaModel JetMoeModel KimiLinearModel Kolibri1Model LagunaModel
    Lfm2Model Lfm2MoeModel Lfm3Model Llama4TextModel LlamaModel LongcatFlashModel MellumModel
    MiMoV2FlashModel MiniCPM3Model MiniMaxM2Model MiniMaxM3VLTextModel MiniMaxModel
    Ministral3Model MinistralModel MistralModel MixtralModel MllamaTextModel
    ModernBertDecoderModel MoshiModel NanoChatModel NemotronHModel NemotronModel Olmo2Model
    Olmo3Model OlmoHybridModel OlmoModel OlmoeModel PersimmonModel Phi3Model Phi4MultimodalModel
    PhiModel PhimoeModel Qwen2Model Qwen2MoeModel Qwen3Model Qwen3MoeModel Qwen3NextModel
    Qwen3_5MoeTextModel Qwen3_5TextModel Qwen4ExpTextModel RecurrentGemmaModel SeedOssModel
    SmolLM3Model SolarOpenModel StableLmModel Starcoder2Model VaultGemmaModel WhisperDecoder
    YoutuModel Zamba2Model ZambaModel ZayaModel
"""
_NOT_ISOLATING = """
    AfmoeModel BertGenerationEncoder BertModel BigBirdModel BioGptModel BloomModel
    CamembertModel Data2VecTextModel ElectraModel ErnieModel FalconModel GptOssModel
    FalconMambaModel GraniteMoeHybridModel Mamba2Model MambaModel MegatronBertModel MptModel
    OPTDecoder RemBertModel RoCBertModel
    RoFormerModel RobertaModel RobertaPreLayerNormModel XGLMModel XLMRobertaModel
    XLMRobertaXLModel XmodModel
"""
# transformers 5.23.0's model classes that receive a causal LM's inputs -> whether they isolate
ISOLATES = dict.fromkeys(_ISOLATING.split(), True) | dict.fromkeys(_NOT_ISOLATING.split(), False)


def isolates_documents(modules):
    """Whether the model whose inputs `modules` (outer first) receive isolates packed documents in
    one process: the first of their classes in ISOLATES (a subclass of a transformers class: that
    class's entry); None when none is listed."""
    for module in modules:
        for cls in type(module).__mro__:
            if cls.__module__.startswith("transformers."):
                if cls.__name__ in ISOLATES:
                    return ISOLATES[cls.__name__]
                break
    return None
