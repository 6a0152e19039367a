"""The SoftmaxGRPO paper's prompts, word for word (its authors' code release), shared by its tasks."""

#: the system message of every paper task but Polaris, AIME 2025 and MATH-500 (those have a user message only)
SYSTEM_PROMPT = "You are a helpful assistant. Think through the problem before providing the answer."
#: OpenThoughts' system message: ``SYSTEM_PROMPT`` and the format it rewards
OPENTHOUGHTS_SYSTEM_PROMPT = (
    SYSTEM_PROMPT + " Put your reasoning in <think> </think> tags, followed by your final answer."
)
#: GSM8K, DeepMath, Polaris, AIME 2025 and MATH-500: the question, a newline, the instruction
MATH_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
#: Countdown: {nums} as a list (``[44, 19, 35]``), {target} the number to reach
COUNTDOWN_TEMPLATE = (
    "Using the numbers {nums}, create an equation that equals {target}. Use only +, -, *, / and parentheses, "
    "and use each number exactly once. Show your work in <think> </think> tags and return the final expression "
    "in <answer> </answer> tags."
)
