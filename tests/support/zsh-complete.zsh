# What zsh offers for a command line, completed the way zsh completes it for a user: an
# interactive zsh in a pseudo-terminal (zsh/zpty) initialises the completion system
# (compinit), sources the completion script, and is sent the line followed by a TAB. Every
# match the completion functions add (compadd) is written to a file, which this script
# prints, one per line; what the completion functions write to standard error (a function
# that is not defined, a syntax error) is printed on standard error.
#
# Usage: zsh -f tests/support/zsh-complete.zsh SCRIPT 'LINE'
# Exits 1 when the completion did not finish within 30 s. Used by tests/process/cli.rs.

if (( $# != 2 )); then
    print -u2 "usage: zsh -f $0 SCRIPT 'LINE'"
    exit 2
fi
dir=$(mktemp -d) || exit 1
export COMP_SCRIPT=$1 COMP_OUT=$dir/matches

# Run by the interactive zsh. compadd is wrapped: calls that only compute matches into an
# array (-O, -A, -D) pass through; every other call records what it adds, then adds it.
cat >$dir/setup.zsh <<'EOF'
exec 2>>"$COMP_OUT.err"
autoload -Uz compinit && compinit -u -D
source "$COMP_SCRIPT"
compadd() {
    if (( ${@[(I)-[OAD]*]} )); then
        builtin compadd "$@"
        return
    fi
    local -a hits
    builtin compadd -A hits "$@"
    (( ${#hits} )) && print -rl -- $hits >>"$COMP_OUT"
    builtin compadd "$@"
}
completion_done() { : >"$COMP_OUT.done" }
comppostfuncs=(completion_done)
EOF

zmodload zsh/zpty
zpty capture zsh -f -i
zpty -w capture "source ${(q)dir}/setup.zsh"
zpty -w -n capture "$2"$'\t'
for _ in {1..300}; do
    [[ -e $COMP_OUT.done ]] && break
    sleep 0.1
done
zpty -d capture
[[ -s $COMP_OUT.err ]] && cat -- $COMP_OUT.err >&2
[[ -e $COMP_OUT ]] && cat -- $COMP_OUT
failed=0
[[ -e $COMP_OUT.done ]] || failed=1
rm -rf -- $dir
if (( failed )); then
    print -u2 "zsh did not finish completing '$2' within 30 s"
fi
exit $failed
