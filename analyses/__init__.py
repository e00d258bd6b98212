"""Analyses over a HookedDecoder (logit lens, attribution, patching, ...)."""
from analyses.memories import Agreement, MemoryLookup, TopTriggers, ValueTokens, agreement, iter_documents, memory_lookup, merge, sub_updates, top_triggers, value_tokens
from analyses.memory_report import memory_report
from analyses.attention import AttentionPatterns, attention_patterns
from analyses.attention_view import AttentionView, attention_view
from analyses.heads import HeadScores, head_scores
from analyses.circuits import CompositionScores, CopyingScores, composition_scores, copying_scores, ov_circuit, qk_circuit
from analyses.ablation import HeadAblationEffects, ablate_heads, head_ablation_effects, logit_diff_metric, loss_metric
from analyses.patching import PatchingResult, Site, attribution_patch, compare_patching, patch
from analyses.lens import TunedLens, compare_lenses, logit_lens, train_tuned_lens
from analyses.attribution import direct_logit_attribution, residual_decomposition
from analyses.pruning import HeadImportance, PruningCurve, evaluate_masks, head_importance, load_pruned, original_heads, prune_by_importance, prune_heads, pruning_schedule, save_pruned, token_batches
from analyses.features import FeatureInputs, FeatureLogits, SAEFeatures, SAELossRecovered, feature_inputs, feature_logits, sae_features, sae_loss_recovered
from analyses.feature_scan import FeatureScan, feature_scan
from analyses.sae_dashboard import FeatureDashboard, feature_dashboard
from analyses.steering import Steering, SteeringVector, steer, steering_vector
from analyses.steering_sweep import SteeringSweep, loglik_metric, steering_sweep, target_logprob_metric
from analyses.circuit_graph import CircuitGraph, circuit_graph
from analyses.edge_attribution import EdgeScores, edge_attribution
from analyses.circuit import Circuit
from analyses.faithfulness import Faithfulness, FaithfulnessCurve, faithfulness, faithfulness_curve
from analyses.path_patching import PathPatching, path_patch
from analyses.sae_eval import SAEEval, sae_eval
from analyses.attribution_graph import AttributionGraph, attribution_graph
from analyses.graph_interventions import FeatureEdit, Intervention, intervene
