"""Output-length and quality predictors: prompt features and LightGBM heads.

Features come from the prompt alone (BEAR paper, App. A.4): prompt statistics, length-
constraint and task-type indicators, and a signed hashing of the tokens into
``NUM_HASH_DIMS`` dimensions, normalised by the token count and projected to ``NUM_PCA``
by a PCA fitted on the training prompts; then per model a categorical model id and the
model's traits (log10 parameter count, log2 max context). Three LightGBM heads share
them: decode tokens (mean head, L2), decode tokens P90 (quantile head, optional) and
quality in [0, 1] (Huber, clipped).

Tokens come from ``tokenize``: lower-cased runs of word characters, and each other
non-space character alone. It is deterministic and has no vocabulary; it is not any
model's BPE tokenizer. Token hashes use ``zlib.crc32``, so features are identical across
processes (Python's ``hash()`` is salted per process).

The modules: ``features`` (tokenizer, statistics, hashing, PCA, the feature spec; the
compiled kernel ``olproute.predict._featurize`` computes them, the Python functions are its twin),
``heads`` (the C API's single-row path, called from ``olproute.predict._rowheads``),
``predictor`` (``Predictor``, saving and loading, ``apply_predictor``, the shipped
predictor's folder ``SHIPPED_DIR``), ``pool`` (``PoolPredictor``: the predictor on the
request path of one pool, as ``olproute serve`` runs it), ``training``
(training files, featurising, fitting) and ``evaluation`` (held-out figures,
``train_and_evaluate``); their public names are re-exported here.

``lightgbm`` is imported where it is used, never at package import.
"""

from olproute.predict.evaluation import (
    Evaluation,
    decode_errors,
    evaluate,
    spearman,
    train_and_evaluate,
)
from olproute.predict.features import (
    FEATURE_VERSION,
    MODEL_FEATURE_NAMES,
    NUM_HASH_DIMS,
    NUM_PCA,
    STAT_NAMES,
    TOKEN_HASH,
    TOKENIZER,
    FeatureSpec,
    Featurizer,
    ModelTraits,
    Pca,
    PredictorError,
    count_tokens,
    fit_pca,
    prompt_stats,
    token_slot,
    tokenize,
)
from olproute.predict.heads import RowHeads
from olproute.predict.pool import PoolPredictor, RequestPredictions
from olproute.predict.predictor import (
    SHIPPED_DIR,
    Predictor,
    apply_predictor,
    decode_prediction,
    quality_prediction,
)
from olproute.predict.training import (
    REQUIRED_COLUMNS,
    PromptMatrix,
    TrainConfig,
    TrainingData,
    featurize_prompts,
    model_traits,
    read_training_file,
    split_prompts,
    train_predictor,
)

__all__ = [
    "FEATURE_VERSION", "MODEL_FEATURE_NAMES", "NUM_HASH_DIMS", "NUM_PCA", "REQUIRED_COLUMNS",
    "SHIPPED_DIR", "STAT_NAMES", "TOKENIZER", "TOKEN_HASH", "Evaluation", "FeatureSpec",
    "Featurizer", "ModelTraits", "Pca", "PoolPredictor", "Predictor", "PredictorError",
    "PromptMatrix", "RequestPredictions", "RowHeads", "TrainConfig", "TrainingData",
    "apply_predictor", "count_tokens", "decode_errors", "decode_prediction", "evaluate",
    "featurize_prompts", "fit_pca", "model_traits", "prompt_stats", "quality_prediction",
    "read_training_file", "spearman", "split_prompts", "token_slot", "tokenize",
    "train_and_evaluate", "train_predictor",
]
