# Renames of branch `cli` (issue 24 item 4). Run over other branches' files after merging, e.g.
#   git diff --name-only main...OTHER -- '*.py' '*.md' | xargs sed -i -E -f RENAMES.sed
# (GNU sed, -E). Each line is one rename; see the notes for the two that need an eye.
s/\bDrafterConfig\b/DFlashConfig/g
s/\bscore_sequences_chain\b/score_dflash_sequences_chain/g
s/\bscore_sequence\b/score_dflash_sequence/g
