# verl_lite test copy of volcengine/verl examples/sglang_multiturn/run_qwen2.5-3b_megatron_gsm8k_multiturn.sh at b178a3cd56f58b2d502255daba591e92833930a7
# (Apache-2.0, the verl authors). Changed for a 2-core CPU machine (paths, sizes, GPU counts), nothing else:
#   data.train_batch_size=1024 -> data.train_batch_size=8
#   data.max_prompt_length=1024 -> data.max_prompt_length=64
#   data.max_response_length=1024 -> data.max_response_length=48
#   ppo_mini_batch_size=256 -> ppo_mini_batch_size=8
#   ppo_micro_batch_size_per_gpu=16 -> ppo_micro_batch_size_per_gpu=4
#   rollout.log_prob_micro_batch_size_per_gpu=16 -> rollout.log_prob_micro_batch_size_per_gpu=4
#   ref.log_prob_micro_batch_size_per_gpu=16 -> ref.log_prob_micro_batch_size_per_gpu=4
#   actor.megatron.pipeline_model_parallel_size=2 -> actor.megatron.pipeline_model_parallel_size=1
#   actor.megatron.virtual_pipeline_model_parallel_size=2 -> actor.megatron.virtual_pipeline_model_parallel_size=1
#   actor.megatron.context_parallel_size=2 -> actor.megatron.context_parallel_size=1
#   actor.megatron.tensor_model_parallel_size=2 -> actor.megatron.tensor_model_parallel_size=1
#   ref.megatron.pipeline_model_parallel_size=2 -> ref.megatron.pipeline_model_parallel_size=1
#   ref.megatron.virtual_pipeline_model_parallel_size=2 -> ref.megatron.virtual_pipeline_model_parallel_size=1
#   ref.megatron.context_parallel_size=2 -> ref.megatron.context_parallel_size=1
#   ref.megatron.tensor_model_parallel_size=2 -> ref.megatron.tensor_model_parallel_size=1
#   rollout.tensor_model_parallel_size=2 -> rollout.tensor_model_parallel_size=1
#   /user/longxiang1/models/Qwen/Qwen2.5-3B-Instruct -> $HOME/models/Qwen/Qwen2.5-3B-Instruct
#   /user/longxiang1/data/ -> $HOME/data/ (train and val)
#   trainer.n_gpus_per_node=8 -> trainer.n_gpus_per_node=1
# run on 8xH100
# make sure your current working directory is the root of the project
# this is a verification training script, the parallel setting should be tuned to your model

set -x

export PYTHONUNBUFFERED=1
export RAY_DEDUP_LOGS=0
export RUST_BACKTRACE=1
export HYDRA_FULL_ERROR=1
export CUDA_DEVICE_MAX_CONNECTIONS=1

ulimit -n 65535

PROJECT_DIR="$(pwd)"
CONFIG_PATH="$PROJECT_DIR/examples/sglang_multiturn/config"

python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='gsm8k_multiturn_megatron_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=8 \
    data.max_prompt_length=64 \
    data.max_response_length=48 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    data.return_raw_chat=True \
    actor_rollout_ref.model.path=$HOME/models/Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.context_parallel_size=1 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.megatron.seed=42 \
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1 \
    actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=1 \
    actor_rollout_ref.ref.megatron.context_parallel_size=1 \
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='gsm8k_async_rl' \
    trainer.experiment_name='qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-n8-mcore-v2505201745_seed42' \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=20 \
    data.train_files=$HOME/data/gsm8k_verl_sgl_multi_turn_preprocessed_v2/train.parquet \
    data.val_files=$HOME/data/gsm8k_verl_sgl_multi_turn_preprocessed_v2/test.parquet \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$PROJECT_DIR/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml" \
    trainer.total_epochs=15 $@

