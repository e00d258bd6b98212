"""Analyses over a HookedDecoder (logit lens, attribution, patching, ...)."""
from probe.analyses.memories import Agreement, MemoryLookup, TopTriggers, ValueTokens, agreement, iter_documents, memory_lookup, merge, sub_updates, top_triggers, value_tokens
from probe.analyses.memory_report import memory_report
from probe.analyses.attention import AttentionPatterns, attention_patterns
from probe.analyses.attention_view import AttentionView, attention_view
from probe.analyses.heads import HeadScores, head_scores
from probe.analyses.circuits import CompositionScores, CopyingScores, composition_scores, copying_scores, ov_circuit, qk_circuit
from probe.analyses.ablation import HeadAblationEffects, ablate_heads, head_ablation_effects, logit_diff_metric, loss_metric
from probe.analyses.patching import PatchingResult, Site, attribution_patch, compare_patching, patch
from probe.analyses.lens import TunedLens, compare_lenses, logit_lens, train_tuned_lens
from probe.analyses.attribution import direct_logit_attribution, residual_decomposition
from probe.analyses.pruning import HeadImportance, PruningCurve, evaluate_masks, head_importance, load_pruned, original_heads, prune_by_importance, prune_heads, pruning_schedule, save_pruned, token_batches
from probe.analyses.features import FeatureInputs, FeatureLogits, SAEFeatures, SAELossRecovered, feature_inputs, feature_logits, sae_features, sae_loss_recovered
from probe.analyses.feature_scan import FeatureScan, feature_scan
from probe.analyses.sae_dashboard import FeatureDashboard, feature_dashboard
from probe.analyses.steering import Steering, SteeringVector, steer, steering_vector
from probe.analyses.steering_sweep import SteeringSweep, loglik_metric, steering_sweep, target_logprob_metric
from probe.analyses.circuit_graph import CircuitGraph, circuit_graph
from probe.analyses.edge_attribution import EdgeScores, edge_attribution
from probe.analyses.circuit import Circuit
from probe.analyses.faithfulness import Faithfulness, FaithfulnessCurve, faithfulness, faithfulness_curve
from probe.analyses.path_patching import PathPatching, path_patch
from probe.analyses.sae_eval import SAEEval, sae_eval
from probe.analyses.attribution_graph import AttributionGraph, attribution_graph
from probe.analyses.graph_interventions import FeatureEdit, Intervention, intervene
from probe.analyses.expert_routing import ExpertRouting, expert_routing
