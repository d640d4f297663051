# The Python API renames of 2026-12-02 (issue 24: family seam, CLI package, names that say what they are).
# Run over code that imports the old names, e.g.
#   git ls-files "*.py" | xargs sed -i -E -f docs/renames.sed
# (GNU sed, -E). Each line is one rename; the commented ones need an eye.
s/\bDrafterConfig\b/DFlashConfig/g
s/\bscore_sequences_chain\b/score_dflash_sequences_chain/g
s/\bscore_sequence\b/score_dflash_sequence/g
s/\bdrafter_config_for_cache\b/dflash_config_for_cache/g
# DFlash's own init / train functions (scorer.init.init_drafter and scorer.train.train_drafter, the
# family-neutral entry points, keep their names): only on the import lines; a file that imported
# DFlash's directly needs its calls renamed by hand (grep -n 'init_drafter\|train_drafter' in it).
s/from scorer\.families\.dflash\.init import init_drafter\b/from scorer.families.dflash.init import init_dflash/g
s/from scorer\.families\.dflash\.train import train_drafter\b/from scorer.families.dflash.train import train_dflash/g
s/\bscorer\.rows\b/scorer.scoring/g
s/\bfrom scorer import rows\b/from scorer import scoring/g
s/\bscorer\/rows\.py\b/scorer\/scoring.py/g
# scorer.metrics.diagnose (the report's pipeline warnings) no longer shares a name with `scorer diagnose`;
# only where it is imported from scorer.metrics (the other `diagnose` names are the command's):
# (calls of it in such a file are renamed by hand: grep -n 'diagnose(' in it)
/^ *from scorer\.metrics import \($/,/^ *\)/ s/\bdiagnose\b/pipeline_warnings/g
/^ *from scorer\.metrics import [^(]/ s/\bdiagnose\b/pipeline_warnings/g
s/\bDiagnoseThresholds\b/PipelineWarningThresholds/g
s/\bscorer\.ddtree\b/scorer.families.dflash.ddtree/g
s/\bscorer\/ddtree\.py\b/scorer\/families\/dflash\/ddtree.py/g
# replay_ddtree, replay_trees and tree_depth moved from scorer.replay to scorer.families.dflash.ddtree
# (only DFlash replays DDTree); an import of them from scorer.replay is split by hand. scorer.replay's
# _check_sequence / _check_rows / _replay are public now (check_sequence, check_anchor_rows,
# replay_walk: the DDTree replays build on them); only scorer/replay.py used them, and hscache has its
# own _check_rows, so no sed line for them.
# "block" is DFlash's draft block; a contiguous range of cache rows read once is a row range:
s/\bhscache\.store\.blocks\b/hscache.store.row_ranges/g
s/\bhscache\/store\/blocks\.py\b/hscache\/store\/row_ranges.py/g
s/\bBlockView\b/RowRangeView/g
s/\bRowBlock\b/RowRangeData/g
# Renames of branch `flags`: a family's package is now its Family row only (plain data, functions bound
# lazily, no torch); what dflash/dflash2/eagle3/mtp's __init__.py held is in <family>/seam.py, and
# each seam's _claims / _effective are public there as claims / effective_config. An import of a seam
# function from the package moves to .seam (the rows, *_KINDS and EVAL_OPTIONS stay in the package, and
# a submodule imported by name is left alone; `import online` from eagle3 meant the function: check it):
/\b(DFLASH2?|EAGLE3|MTP|[A-Z0-9]+_KINDS|EVAL_OPTIONS)\b|import (attention|checkpoint|config|ddtree|diagnose|draft|drafting|features|init|layouts|model|proposal|proposals|score|seam|speculators|train)\b/! s/\bfrom scorer\.families\.(dflash|dflash2|eagle3|mtp) import /from scorer.families.\1.seam import /g
s/\bfrom scorer\.families import dflash\b/from scorer.families.dflash import seam as dflash/g
# scorer.cli.shared.lookup_settings (n-gram's two flags) is family_settings (every family's Family.flags);
# a command using drafting_flags needs @click.command(cls=ScoringCommand) (its family flags' place):
s/\blookup_settings\b/family_settings/g
# The scorer by role (issue 32, 2026-12-03): the flat modules of scorer/ moved into rules/ (each engine's
# verification rule), offline/ (the replay over cached rows), online/ (the target in the loop),
# diagnose/ and studies/. scorer.online and scorer.diagnose are packages now: their old modules are
# scorer.online.greedy and scorer.diagnose.ranking. These lines are idempotent. The old paths kept one
# release (scorer.evaluate, scorer.online_sampled, `from scorer.online import OnlineConfig, run_online`)
# were removed 2026-12-07 (issue 47): importing one fails naming its new path (scorer.MOVED).
s/\bscorer\.online\.(greedy|sampled)\b/scorer.online@@\1/g
s/\bscorer\.online\b([^@]|$)/scorer.online.greedy\1/g
s/\bscorer\.online@@/scorer.online./g
s/\bscorer\.online_sampled\b/scorer.online.sampled/g
s/\bscorer\/online\.py\b/scorer\/online\/greedy.py/g
s/\bscorer\/online_sampled\.py\b/scorer\/online\/sampled.py/g
s/\bscorer\.diagnose\.(ranking|run)\b/scorer.diagnose@@\1/g
s/\bscorer\.diagnose\b([^@]|$)/scorer.diagnose.ranking\1/g
s/\bscorer\.diagnose@@/scorer.diagnose./g
s/\bscorer\.diagnose_run\b/scorer.diagnose.run/g
s/\bscorer\/diagnose\.py\b/scorer\/diagnose\/ranking.py/g
s/\bscorer\/diagnose_run\.py\b/scorer\/diagnose\/run.py/g
s/\bscorer([./])verification\b/scorer\1rules\1expectation/g
s/\bscorer([./])vllm_rejection\b/scorer\1rules\1vllm_chain/g
s/\bscorer([./])online_rules\b/scorer\1rules\1sglang_tree/g
s/\bscorer([./])(replay|sequences|scoring|sampled_tau)\b/scorer\1offline\1\2/g
s/\bscorer([./])served\b/scorer\1offline\1sampled_view/g
s/\bfrom scorer import served\b/from scorer.offline import sampled_view as served/g
s/\bscorer([./])served_eval\b/scorer\1studies\1tau_as_served/g
s/\bscorer([./])(evaluate|compare|compare_settings|sweep|distributed)\b/scorer\1studies\1\2/g
# The command-line renames of 2026-12-03 (issue 35 item 2), for scripts that call `hscache extract` /
# `scorer online|eval|compare|sweep`: the stored-logits count first, then sampling's top-k (the engines'
# name). Only over command lines of these tools (another tool's --top-k, e.g. vLLM's, is already right):
#   sed -i -E -f docs/renames.sed run.sh
/hscache extract/ s/(^|[^-[:alnum:]])--top-k\b/\1--logits-top-k/g
s/--sample-top-k\b/--top-k/g
# Issue 32, the rules (2026-12-03): each engine's acceptance is decided in scorer/rules/ only. The old
# import paths keep working one release (re-exported there): RoundLog, chain_depth, slot_matches,
# check_sequence, check_anchor_rows from scorer.offline.replay (now scorer.rules.onehot_chain);
# RowBlock, processed_rows, sglang_penalty_history, SGLANG_PENALTY, VLLM_PENALTY from
# scorer.online.sampled (now scorer.rules.penalties); probabilistic_rounds from
# scorer.offline.sampled_view (now scorer.rules.expectation). Single-name imports move with these:
s/\bfrom scorer\.offline\.replay import (RoundLog|chain_depth|slot_matches|check_sequence|check_anchor_rows)$/from scorer.rules.onehot_chain import \1/
s/\bfrom scorer\.online\.sampled import (RowBlock|processed_rows|sglang_penalty_history|SGLANG_PENALTY|VLLM_PENALTY)$/from scorer.rules.penalties import \1/
s/\bfrom scorer\.offline\.sampled_view import probabilistic_rounds$/from scorer.rules.expectation import probabilistic_rounds/
# One name per unit in the report keys: a scored sequence is a "request" (tau per request); "sequences"
# stays for what a cache holds. eval report schema_version 2: sampling.modes.<mode>.n_sequences ->
# n_requests (scorer.offline.sampled_tau.SampledTau.n_sequences -> n_requests); compare-settings
# report schema_version 2: settings[].sequences -> requests. In code that reads these documents:
s/\bn_sequences\b/n_requests/g
# (settings[].sequences of a compare-settings document: rename by hand, ["sequences"] means a cache's
# count elsewhere.)
# The compatibility modules removed 2026-12-07 (issue 47): init_drafter and train_drafter live in
# scorer/make.py and are exported as scorer.init_drafter / scorer.train_drafter (the old paths fail naming it):
s/\bfrom scorer\.(init|train) import /from scorer import /g
s/\bscorer([./])(init|train)\b/scorer\1make/g
